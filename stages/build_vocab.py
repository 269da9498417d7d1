"""Stage build_vocab: word or joint BPE vocabularies, and train/valid as token-id arrays."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.data.vocab import build_vocabs
from transformer.io import atomic_dir
from transformer.stage import PARAMS, stage, workers


@click.command()
@PARAMS
@click.option("--tokenized", required=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path))
@stage
def main(params_path: Path, tokenized: Path, out: Path) -> None:
    params = load_params(params_path)
    d, v = params.data, params.vocab
    with atomic_dir(out) as tmp:
        sizes = build_vocabs(
            tokenized, tmp, (d.src_lang, d.tgt_lang), v.kind, v.size, v.min_freq, "train", d.valid, v.seed, workers()
        )
    click.echo(f"{v.kind} vocabulary: {sizes['src_size']} source, {sizes['tgt_size']} target entries", err=True)


if __name__ == "__main__":
    main()
