"""The whole DAG under `dvc repro`, on a toy corpus, in a fresh git repository."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    BIN,
    DVC,
    mlflow_client,
    mlflow_runs,
    project_copy,
    run,
    same_values,
    tiny_params,
    write_toy_corpus,
)
from test_experiments import DOWNSTREAM_OF_TRAIN

from bench.toy import ROOT, RUN_RECORD, SMALL, clean_run, fingerprint, start_repro, tree
from transformer.evaluation.score import BOOTSTRAP, with_interval
from transformer.kernels.memory import KERNEL_CACHE, mimalloc_library

STAGES = {"download", "tokenize", "build_vocab"} | DOWNSTREAM_OF_TRAIN
TIMED = STAGES - {"report", "export"}  # the report reads the others' times, and export runs after it


@pytest.mark.slow
def test_dvc_repro_runs_all_stages_learns_and_caches(tmp_path):
    repo = project_copy(tmp_path, tiny_params(**{"train.epochs": 20}))  # at 12 the toy model could still repeat a word
    first = run([DVC, "repro"], repo, timeout=600)
    for stage in STAGES:
        assert f"Running stage '{stage}'" in first.stdout
    assert (repo / "data/export/ctranslate2/model.bin").exists()
    scores = json.loads((repo / "reports/scores.json").read_text())
    assert set(scores) == {"val", "test2016"}
    assert scores["test2016"]["bleu"] > 80, scores  # the toy translation is learnable
    assert (repo / "data/translations/test2016.txt").read_text().count("\n") == 60
    assert "tok:13a" in (repo / "reports/scores.md").read_text()
    _assert_report_has_every_stage_and_score(repo, scores)

    translated = run(
        [str(BIN / "transformer"), "translate", "--model", "data/model/model.pt", "--beam", "1"],
        repo,
        input_text="kan pen.\n\nbin don.\n",
    )
    assert translated.stdout.splitlines() == ["ak ep.", "", "ib od."]

    _assert_mlflow_runs_have_curves_and_scores(repo, scores)

    again = run([DVC, "repro"], repo)
    assert "Running stage" not in again.stdout

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["decode"]["beam"] = 1
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    downstream = run([DVC, "repro"], repo)
    ran = {line.split("'")[1] for line in downstream.stdout.splitlines() if line.startswith("Running stage")}
    assert ran == {"decode@val", "decode@test2016", "score", "report"}

    shown = run([DVC, "metrics", "show"], repo).stdout
    assert "reports/scores.json" in shown and "test2016.bleu" in shown
    assert json.loads((repo / "reports/decode/val.json").read_text())["peak_rss_mb"] > 100  # MiB, torch included


def _assert_report_has_every_stage_and_score(repo, scores):
    report = (repo / "reports/reproduction.md").read_text()
    assert report.count("<!-- begin toy de-en -->") == 1
    timed = {p.stem for p in (repo / "data/timings").glob("*.json")}
    assert timed == TIMED
    for stage in timed:
        assert f"| {stage} |" in report
    test2016 = scores["test2016"]
    low, high = test2016["bleu_ci95"]
    assert low <= test2016["bleu"] <= high
    assert f"| toy | de→en | test2016 | {with_interval(test2016['bleu'], [low, high])} |" in report  # the headline row
    assert f"nrefs:1|bs:{BOOTSTRAP}|seed:12345|case:mixed|eff:no|tok:13a" in report.replace("\\|", "|")
    source = (repo / "data/raw/test2016.de").read_text().splitlines()[0]
    ours = (repo / "data/translations/test2016.txt").read_text().splitlines()[0]
    assert "Translations of a few test2016 sentences:" in report and f"| 1 | {source} | " in report
    assert f" | {ours} | " in report.split("| 1 | ")[1].splitlines()[0]  # the first line's translation, ours


def _assert_mlflow_runs_have_curves_and_scores(repo, scores):
    """The training's run holds params and curves; the evaluation's, nested under it, the scores."""
    client = mlflow_client(repo)
    runs = list(mlflow_runs(repo).values())
    (run_,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    (evaluation,) = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == run_.info.run_id]
    assert run_.data.params["model.d_model"] == "32" and "version.torch" in run_.data.params
    assert len(client.get_metric_history(run_.info.run_id, "loss")) > 20
    assert client.get_metric_history(run_.info.run_id, "val_loss")
    assert run_.data.metrics["peak_rss_mb_rank_0"] > 100  # MiB: torch alone takes more
    assert client.get_metric_history(run_.info.run_id, "batch_wait_ms")
    assert "test2016_bleu" not in run_.data.metrics and "decode.beam" not in run_.data.params
    assert evaluation.data.metrics["test2016_bleu"] == scores["test2016"]["bleu"]
    ends = [evaluation.data.metrics[f"test2016_bleu_ci_{end}"] for end in ("low", "high")]
    assert ends == scores["test2016"]["bleu_ci95"]  # the interval, as two numbers
    assert evaluation.data.params["decode.beam"] == "2"
    assert run_.data.tags["direction"] == "de-en"
    assert run_.data.tags["allocator"] == ("mimalloc" if mimalloc_library() else "glibc")  # the stage preloaded it
    assert run_.data.tags["kernel_cache"] == str(KERNEL_CACHE)  # and limited oneDNN's cache
    trained = {a.path for a in client.list_artifacts(run_.info.run_id)}
    assert {"model", "vocab", "checkpoints"} <= trained and "reports" not in trained  # the report is the evaluation's
    assert {"translations/test2016.txt", "reports/scores.md", "reports/reproduction.md"} <= {
        a.path for d in ("translations", "reports") for a in client.list_artifacts(evaluation.info.run_id, d)
    }
    (version,) = client.search_model_versions("name='transformer-multi30k-de-en'")  # the export stage registered it
    assert version.run_id == run_.info.run_id


@pytest.mark.slow
def test_tokenize_param_change_reruns_only_downstream_stages(tmp_path):
    params = tiny_params(**{"train.epochs": 1, "average.last_k": 1})
    repo = project_copy(tmp_path, params)
    run([DVC, "repro", "build_vocab"], repo)
    params["tokenize"]["max_len"] = 6
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = run([DVC, "status"], repo).stdout
    assert "tokenize" in status and "download" not in status
    rerun = run([DVC, "repro", "build_vocab"], repo).stdout
    assert "Running stage 'tokenize'" in rerun and "Running stage 'download'" not in rerun
    dropped = json.loads((repo / "reports/tokenize.json").read_text())["train.dropped_long"]
    assert dropped > 0


def test_download_stage_reads_the_mirror_and_verifies_checksums(tmp_path):
    from conftest import ROOT

    corpus = write_toy_corpus(tmp_path / "plain").parent
    mirror = tmp_path / "mirror" / "toy"
    mirror.mkdir(parents=True)
    entry = {}
    for path in sorted(p for p in corpus.iterdir() if p.suffix in (".de", ".en")):
        packed = mirror / f"{path.name}.gz"
        packed.write_bytes(gzip.compress(path.read_bytes()))
        split, lang = path.name.split(".")
        digest = hashlib.sha256(packed.read_bytes()).hexdigest()
        entry.setdefault(split, {})[lang] = [{"url": f"https://example.org/toy/{packed.name}", "sha256": digest}]
    registry = tmp_path / "corpora.yaml"
    registry.write_text(yaml.safe_dump({"toy": entry}))
    params = tiny_params()
    params["data"]["registry"] = str(registry)
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(params))
    mirror_env = {"TRANSFORMER_DATA_MIRROR": str(tmp_path / "mirror")}
    cmd = [str(BIN / "python"), "stages/download.py", "--params", str(params_path), "--out", str(tmp_path / "raw")]
    run(cmd, ROOT, env=mirror_env)
    assert (tmp_path / "raw/train.de").read_bytes() == (corpus / "train.de").read_bytes()

    shutil.rmtree(tmp_path / "raw")
    (mirror / "val.en.gz").write_bytes(gzip.compress(b"tampered\n"))
    failed = run(cmd, ROOT, check=False, env=mirror_env)
    assert failed.returncode == 1
    assert "val.en.gz: checksum mismatch" in failed.stderr and "Traceback" not in failed.stderr
    assert not (tmp_path / "raw").exists()


# The toy pipeline at its smallest that still exercises every path: 3 epochs, a checkpoint every
# 10 updates (so a kill in the first epoch has something to resume from).
@pytest.fixture(scope="module")
def clean_repro(tmp_path_factory) -> Path:
    """One clean `dvc repro` of the toy pipeline at the smallest settings, shared read-only."""
    return clean_run(tmp_path_factory.mktemp("clean"))


# Two clean repros in separate directories are byte-identical: tests/test_soak.py's soak starts with
# two uninterrupted runs of these settings and holds them to each other (bench/soak.py's differences),
# so no test here pays for a second clean run.


# model.pt records its run: the MLflow run id (each repro opens its own run) and the training's
# wall time. Everything else in it, weights first, must be equal bit for bit.
def _assert_same_model(repo: Path, reference: Path) -> None:
    import torch

    mine, theirs = (torch.load(r / "data/model/model.pt", weights_only=True) for r in (repo, reference))
    assert mine.keys() == theirs.keys()
    for key in sorted(set(theirs) - set(RUN_RECORD)):
        assert same_values(mine[key], theirs[key]), f"model.pt differs in '{key}'"


def _kill_when(repro: subprocess.Popen, ready, what: str, seconds: float = 900) -> None:
    """SIGKILLs `dvc repro` and everything it started as soon as `ready()` holds."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert repro.poll() is None, f"dvc repro ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {seconds} s"
        time.sleep(0.002)
    os.killpg(repro.pid, signal.SIGKILL)
    repro.wait()


def _temp_files(repo: Path) -> list[str]:
    return sorted(str(p.relative_to(repo)) for p in (repo / "data").rglob(".*.tmp"))


@pytest.mark.slow
def test_repro_killed_in_every_writing_stage_resumes_to_a_clean_runs_outputs(tmp_path, clean_repro):
    """kill -9 of `dvc repro` inside download, tokenize and build_vocab (mid-write: their output
    directory is being built aside) and train (after a checkpoint); each rerun removes what the
    killed one left, train resumes, and the outputs equal a clean run's."""
    repo = project_copy(tmp_path, tiny_params(**SMALL))
    data = repo / "data"
    # download blocks on a FIFO standing for the last source file, its output half-built: a kill mid-write by design
    source = repo / "toy" / "val.en"
    source.unlink()
    os.mkfifo(source)
    _kill_when(start_repro(repo), lambda: list(data.glob(".raw.*.tmp")), "download writing data/raw")
    assert not (data / "raw").exists() and _temp_files(repo), "the kill did not land mid-write"
    source.unlink()
    run(["git", "checkout", "--", "toy/val.en"], repo)

    _kill_when(start_repro(repo), lambda: list(data.glob(".tokenized.*.tmp")), "tokenize writing data/tokenized")
    assert not (data / "tokenized").exists() and list(data.glob(".tokenized.*.tmp"))
    assert not list(data.glob(".raw.*.tmp")), "the rerun of download removed the temp folder the killed one left"

    _kill_when(start_repro(repo), lambda: list(data.glob(".vocab.*.tmp")), "build_vocab writing data/vocab")
    assert not (data / "vocab").exists() and list(data.glob(".vocab.*.tmp"))
    assert not list(data.glob(".tokenized.*.tmp"))

    _kill_when(start_repro(repo), lambda: list((data / "checkpoints").glob("ckpt_*.pt")), "a checkpoint")
    assert not (data / "model").exists()

    rerun = run([DVC, "repro"], repo, timeout=1200)
    assert "resuming from data/checkpoints/ckpt_" in rerun.stderr + rerun.stdout
    assert "Running stage 'download'" not in rerun.stdout and "Running stage 'build_vocab'" not in rerun.stdout
    assert _temp_files(repo) == []
    for name in ("data/raw", "data/tokenized", "data/vocab", "data/translations"):
        assert tree(repo / name) == tree(clean_repro / name), name
    _assert_same_model(repo, clean_repro)
    assert "Data and pipelines are up to date" in run([DVC, "status"], repo).stdout


@pytest.mark.slow
def test_a_second_member_trains_alone_and_every_stage_after_train_uses_both(tmp_path, clean_repro):
    import torch

    repo = tmp_path / "repo"
    shutil.copytree(clean_repro, repo, symlinks=True)
    trained = tree(repo / "data/checkpoints")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["members"] = 2
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    ensemble = run([DVC, "repro"], repo, timeout=600)
    assert "member 2 of 2: seed 2" in ensemble.stderr and "resuming from data/checkpoints/ckpt_" in ensemble.stderr
    assert {k: v for k, v in tree(repo / "data/checkpoints").items() if not k.startswith("seed2/")} == trained
    model = torch.load(repo / "data/model/model.pt", weights_only=True)
    assert [m["seed"] for m in model["members"]] == [2] and "holds the first member's alone" in ensemble.stderr
    ran = {line.split("'")[1] for line in ensemble.stdout.splitlines() if line.startswith("Running stage")}
    assert ran == DOWNSTREAM_OF_TRAIN
    assert "| ensemble | 2 models, seeds 1, 2:" in (repo / "reports/reproduction.md").read_text()


@pytest.mark.slow
def test_registry_change_reruns_download_and_mirror_change_reruns_nothing(tmp_path, clean_repro):
    repo = tmp_path / "repo"
    shutil.copytree(clean_repro, repo, symlinks=True)
    mirrored = run([DVC, "repro"], repo, env={"TRANSFORMER_DATA_MIRROR": str(tmp_path / "elsewhere")})
    assert "Running stage" not in mirrored.stdout  # where the files come from is not what they are
    registry = repo / "toy" / "corpora.yaml"
    registry.write_text(registry.read_text() + "# a comment is a change of the file\n")
    assert "download" in run([DVC, "status"], repo).stdout
    rerun = run([DVC, "repro"], repo)
    assert "Running stage 'download'" in rerun.stdout
    assert "Running stage 'tokenize'" not in rerun.stdout  # the same files downloaded: nothing downstream changes


@pytest.mark.slow
def test_a_rerun_is_identical_to_the_reference_another_seed_is_judged_and_another_recipe_refused(tmp_path, clean_repro):
    from transformer.config import load_params
    from transformer.evaluation import verdict

    repo = tmp_path / "repo"
    shutil.copytree(clean_repro, repo, symlinks=True)
    assert json.loads((repo / "reports/verdict.json").read_text())["verdict"] == "no reference"
    params = load_params(repo / "params.yaml")
    reference = verdict.reference_dir(params, repo / verdict.REFERENCES)
    scores = json.loads((repo / "reports/scores.json").read_text())
    translations, raw = repo / "data/translations", repo / "data/raw"
    verdict.record(params, scores, translations, raw, reference, host_class="here", commit=None)

    def judged(**changes) -> tuple[dict, str]:
        if changes:
            raw = yaml.safe_load((repo / "params.yaml").read_text())
            for key, value in changes.items():
                section, name = key.split(".")
                raw[section][name] = value
            (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        done = run([DVC, "repro"], repo, timeout=600)
        return json.loads((repo / "reports/verdict.json").read_text()), done.stdout + done.stderr

    found, said = judged()
    assert found["verdict"] == "identical" and found["line"] in said  # only the report reran, and said it
    assert run([str(BIN / "transformer"), "verdict"], repo).stdout.strip() == found["line"]  # as make repro ends
    evaluation = json.loads((repo / "reports/evaluation.json").read_text())["mlflow_run_id"]
    assert mlflow_client(repo).get_run(evaluation).data.tags["verdict"] == "identical"

    found, said = judged(**{"train.seed": 2})
    assert found["verdict"] in ("reproduced", "differs") and found["line"] in said, found
    low, high = found["diff_ci95"]
    assert low <= found["diff"] <= high and 0 <= found["p_bs"] <= 1
    assert (
        f"Against the committed reference: {found['verdict']}: {found['testset']} BLEU"
        in (repo / "reports/reproduction.md").read_text()
    )
    assert "reports/verdict.json" in run([DVC, "metrics", "show"], repo).stdout

    found, said = judged(**{"decode.beam": 1})
    assert found["verdict"] == "not compared" and "another recipe (decode.beam is 1 here, 2 in" in found["line"]


@pytest.mark.slow
def test_every_committed_row_is_what_todays_code_makes_on_its_class(clean_repro):
    """Each committed reference holds the fingerprint of the code that made it on its class (bench/reference.py):
    on that class, today's must be the same, or the rows it names would no longer be reproduced."""
    import warnings

    from transformer.evaluation.system import numerics_class
    from transformer.evaluation.verdict import RECORD, REFERENCES

    records = {p.parent.name: json.loads(p.read_text()) for p in sorted((ROOT / REFERENCES).glob(f"*/{RECORD}"))}
    assert records, f"no committed reference under {REFERENCES}"
    here, today = numerics_class(), fingerprint(clean_repro)
    judged = {name: r for name, r in records.items() if r["fingerprint"]["numerics_class"] == here}
    if not judged:
        made_on = sorted({r["fingerprint"]["numerics_class"] for r in records.values()})
        warnings.warn(f"the committed rows were made on {made_on}: on {here} this test cannot judge them", stacklevel=1)
    stale = sorted(name for name, r in judged.items() if r["fingerprint"]["toy"] != today)
    remake = "remake them (make repro, make reference)"
    assert not stale, f"today's code would not reproduce the rows {stale} on {here}: {remake}"
