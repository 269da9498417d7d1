"""Stage tokenize: spaCy rule-based, reversible; the pairs params.tokenize filters out leave train only."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.data.tokenize import tokenize_corpus
from transformer.io import atomic_dir, write_json
from transformer.stage import PARAMS, stage, workers


@click.command()
@PARAMS
@click.option("--raw", required=True, type=click.Path(path_type=Path), help="download's output directory")
@click.option("--out", required=True, type=click.Path(path_type=Path))
@click.option("--report", required=True, type=click.Path(path_type=Path), help="JSON counts of kept and dropped pairs")
@stage
def main(params_path: Path, raw: Path, out: Path, report: Path) -> None:
    params = load_params(params_path)
    d, t = params.data, params.tokenize
    splits = sorted({p.name.rsplit(".", 1)[0] for p in raw.glob(f"*.{d.src_lang}")})
    with atomic_dir(out) as tmp:
        stats = tokenize_corpus(
            raw,
            tmp,
            splits,
            (d.src_lang, d.tgt_lang),
            "train",
            max_len=t.max_len,
            workers=workers(),
            max_ratio=t.max_ratio,
            dedupe=t.dedupe,
        )
    write_json(report, stats)
    click.echo(", ".join(f"{k}: {v}" for k, v in stats.items()), err=True)


if __name__ == "__main__":
    main()
