"""Stage report: this run's section of reports/reproduction.md (scores beside published ones and our baselines,
a few test sentences translated, the verdict against the committed reference, which it also writes as JSON
and prints)."""

from pathlib import Path

import click

from transformer.config import load_params
from transformer.io import check_aligned, read_json, read_lines, write_json, write_text
from transformer.stage import PARAMS, stage


@click.command()
@PARAMS
@click.option("--scores", required=True, type=click.Path(path_type=Path), help="the score stage's metrics JSON")
@click.option(
    "--signatures", required=True, type=click.Path(path_type=Path), help="the score stage's sacreBLEU signatures"
)
@click.option(
    "--evaluation",
    required=True,
    type=click.Path(path_type=Path),
    help="the score stage's JSON naming the MLflow run of these scores",
)
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path), help="the model that translated")
@click.option(
    "--timings", required=True, type=click.Path(path_type=Path), help="directory of the stages' --timing files"
)
@click.option("--raw", required=True, type=click.Path(path_type=Path), help="download's output directory")
@click.option("--translations", required=True, type=click.Path(path_type=Path), help="directory of <testset>.txt")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="the report; other sections are kept")
@click.option(
    "--references",
    required=True,
    type=click.Path(path_type=Path),
    help="directory of the committed references, a subdirectory a report section",
)
@click.option("--verdict", "verdict_path", required=True, type=click.Path(path_type=Path), help="the verdict's JSON")
@click.option(
    "--track/--no-track", default=True, show_default=True, help="log this section into that evaluation's MLflow run"
)
@stage
def main(
    params_path: Path,
    scores: Path,
    signatures: Path,
    evaluation: Path,
    model_path: Path,
    timings: Path,
    raw: Path,
    translations: Path,
    out: Path,
    references: Path,
    verdict_path: Path,
    track: bool,
) -> None:
    from transformer import checkpoints
    from transformer.evaluation import report, verdict
    from transformer.evaluation.system import describe_model, host_class
    from transformer.tracking import git_commit

    params = load_params(params_path)
    run_id = read_json(evaluation)["mlflow_run_id"] if track else None  # read before anything is written
    d = params.data
    model = checkpoints.load(model_path)
    scored = read_json(scores)
    scored = {t: scored[t] for t in params.decode.testsets if t in scored}  # in params order
    anchors = report.load_anchors(d.corpus, d.src_lang, d.tgt_lang)
    testset = report.headline_testset(scored, anchors)
    files = [raw / f"{testset}.{d.src_lang}", raw / f"{testset}.{d.tgt_lang}", translations / f"{testset}.txt"]
    sides = [read_lines(f) for f in files]
    for path, lines in zip(files[1:], sides[1:]):
        check_aligned([files[0], path], [len(sides[0]), len(lines)], f"{testset} test set")
    found = verdict.judge(params, translations, raw, verdict.reference_dir(params, references))
    body = report.section(
        params,
        scored,
        read_json(signatures),
        describe_model(model),
        report.load_timings(timings, params.decode.testsets),
        anchors,
        host_class(),
        git_commit(),
        shown=(testset, report.examples(*sides)),
        verdict=verdict.paragraph(found),
    )
    key = report.key(params)
    existing = out.read_text(encoding="utf-8") if out.exists() else ""
    write_text(out, report.merge(existing, key, body))
    write_json(verdict_path, found | {"host_class": host_class()})
    if track:
        from transformer.tracking import log_to_run

        # the section holds one evaluation's scores (its beam, alpha), so not the training's run
        log_to_run(run_id, texts={"reports/reproduction.md": body}, tags={"verdict": found["verdict"]})
    click.echo(f"{out}: section {key} written", err=True)
    click.echo(found["line"], err=True)


if __name__ == "__main__":
    main()
