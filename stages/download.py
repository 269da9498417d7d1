"""Stage download: the corpus named in params, from its URLs or $TRANSFORMER_DATA_MIRROR, verified."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.data.download import download_corpus
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--out", required=True, type=click.Path(path_type=Path), help="directory for <split>.<lang> text files")
@stage
def main(params_path: Path, out: Path) -> None:
    d = load_params(params_path).data
    counts = download_corpus(d.registry, d.corpus, (d.src_lang, d.tgt_lang), out)
    click.echo(", ".join(f"{name}: {n} lines" for name, n in counts.items()), err=True)


if __name__ == "__main__":
    main()
