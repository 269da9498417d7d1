"""Stage decode: one test set through beam search, detokenized, in input order."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.io import read_lines, write_json, write_lines
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path))
@click.option(
    "--vocab",
    required=True,
    type=click.Path(path_type=Path),
    help="build_vocab's output directory, checked against the model",
)
@click.option("--source", required=True, type=click.Path(path_type=Path), help="tokenized source text")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="translations, one line per source line")
@click.option("--report", required=True, type=click.Path(path_type=Path), help="JSON decoding speed")
@stage
def main(params_path: Path, model_path: Path, vocab: Path, source: Path, out: Path, report: Path) -> None:
    from transformer.data.vocab import load_vocabs
    from transformer.decoding.translate import Search, Translator, timed_translate
    from transformer.evaluation.system import host_class
    from transformer.kernels.memory import peak_rss_mb

    p = load_params(params_path).decode
    translator = Translator(model_path)
    translator.check_vocab(*load_vocabs(vocab), vocab)
    lines = read_lines(source)
    hyps, speed = timed_translate(translator, lines, Search.of(p), progress=True)
    write_lines(out, hyps)
    # the process's memory, model included; the class its speed was measured on
    write_json(report, speed | {"beam": p.beam, "peak_rss_mb": round(peak_rss_mb()), "host_class": host_class()})
    click.echo(f"{source}: {speed['sentences_per_s']} sentences/s, {speed['tokens_per_s']} tokens/s", err=True)


if __name__ == "__main__":
    main()
