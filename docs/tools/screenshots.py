"""Takes the pictures of docs/tracking.md: the MLflow UI and `dvc plots show` of a toy run, in a
headless browser, so that a reader sees what the page describes before training anything.

    pip install playwright                                # drives the browser; not a project dependency
    python docs/tools/screenshots.py --out docs/images
    python docs/tools/screenshots.py --out /tmp/shots --workdir /tmp/toy   # keeps the toy run for another go

The browser is Debian's Chromium (`apt-get install chromium`; --chromium names another): playwright
drives it and downloads none of its own. The toy project (bench/toy.py: its corpus and tiny params, in
a fresh git + DVC copy) is trained by `dvc repro`, then two experiments follow: `warmup-50` retrains
(`--temp`, so the workspace keeps the first training) and `beam-1` decodes the first model again. The
experiment thus has two trainings, the first with two evaluations; the first model's registered
version is promoted to `champion`. `mlflow ui` serves the store on a free loopback port, and the
browser shows each view as a user would set it up (columns chosen, runs unfolded, charts left out)
before the screenshot. `dvc plots show` writes a page that loads Vega from a CDN: the browser is
answered from the same versions' npm packages (`npm pack`), so a run needs the npm registry, not the
CDN. A --workdir that holds a finished toy run is reused: only what is missing runs again. The whole
run takes ten to fifteen minutes on two cores; each picture is 1400 px wide and written atomically."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a file, it imports this checkout's package and toy project

from bench.toy import BIN, DVC, free_port, project_copy, run, tiny_params, tool_env  # noqa: E402
from transformer.io import atomic_path  # noqa: E402

WIDTH, HEIGHT = 1400, 900  # the browser's window; a picture is this wide and at most about this high
EXPERIMENT = "toy-de-en"  # the toy recipe's MLflow experiment
RETRAIN = ("warmup-50", "train.warmup=50")  # an experiment that trains again: a second training
REDECODE = ("beam-1", "decode.beam=1")  # one that decodes the first model again: its second evaluation
ALIAS = "champion"
CURVES = ("loss", "lr", "tokens_per_s", "val_bleu", "val_loss", "val_ppl")  # the training's charts shown
RUN_NAME = "attributes.`Run Name`"  # the runs table's first column, always shown
TRAINING_COLUMNS = {  # the runs table's columns beside the standard ones, with their widths in pixels
    RUN_NAME: 220,
    "attributes.`Models`": 260,
    "metrics.`val_bleu`": 110,
    "metrics.`val_loss`": 150,
    "params.`train.warmup`": 120,
}
EVALUATION_COLUMNS = {
    RUN_NAME: 340,
    "metrics.`test2016_bleu`": 130,
    "metrics.`test2016_chrf`": 130,
    "params.`decode.beam`": 120,
}
CDN = re.compile(r"https://cdn\.jsdelivr\.net/npm/((?:@[^/@]+/)?[^/@]+)@([^/]+)$")  # dvc plots' scripts
TIMEOUT_MS = 180_000  # for a view to show its content: the UI is slow on a busy machine


@dataclass(frozen=True)
class Toy:
    """The toy run's ids, which the UI's addresses and stored view settings name."""

    repo: Path
    experiment_id: str
    training_id: str  # the first training, whose model is promoted
    trainings: tuple[str, ...]
    model: str  # the registered model's name


def toy_run(workdir: Path) -> Toy:
    """The toy project in `workdir`/repo, trained, experimented on and its first model promoted; what a
    reused workdir has done already is not done again."""
    repo = workdir / "repo"
    if not repo.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        project_copy(workdir, tiny_params())
    run([DVC, "repro"], repo, timeout=3600)
    done = run([DVC, "exp", "list", "--name-only"], repo).stdout.split()
    for (name, change), where in ((RETRAIN, ["--temp"]), (REDECODE, [])):  # --temp: the workspace keeps the first
        if name not in done:
            run([DVC, "exp", "run", *where, "-n", name, "-S", change], repo, timeout=3600)
    run([str(BIN / "transformer"), "promote", "1", "--alias", ALIAS], repo)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id])
    (model,) = client.search_registered_models()
    return Toy(
        repo,
        experiment.experiment_id,
        client.get_model_version(model.name, "1").run_id,
        tuple(r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags),
        model.name,
    )


@contextlib.contextmanager
def mlflow_ui(repo: Path) -> Iterator[str]:
    """`mlflow ui` on the toy run's store, as `make ui` serves it, on a free loopback port: its address."""
    port = free_port()
    log_path = repo / "mlflow-ui.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{repo / 'mlflow.db'}"]
            + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=repo,
            env=tool_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, which the stop takes whole
        )
        try:
            _wait_for(f"http://127.0.0.1:{port}/health", server, log_path)
            yield f"http://127.0.0.1:{port}"
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)


def _wait_for(url: str, server: subprocess.Popen, log: Path, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        if server.poll() is not None:
            raise click.ClickException(f"mlflow ui exited {server.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise click.ClickException(f"{url} did not answer within {seconds:.0f} s")
        time.sleep(0.5)


def dvc_plots(repo: Path) -> Path:
    """`dvc plots show`'s page of the workspace's plots: the first training's."""
    run([DVC, "plots", "show", "-o", "dvc_plots"], repo)
    return repo / "dvc_plots" / "index.html"


def npm_scripts(page: Path, cache: Path) -> dict[str, bytes]:
    """The CDN scripts a page loads (`https://cdn.jsdelivr.net/npm/NAME@VERSION`), each read from its npm
    package: the file its package.json names for that CDN."""
    found = {}
    cache.mkdir(parents=True, exist_ok=True)
    for url in re.findall(r'<script src="([^"]+)"', page.read_text(encoding="utf-8")):
        name, version = CDN.match(url).groups()
        packed = json.loads(run(["npm", "pack", "--json", f"{name}@{version}"], cache).stdout)
        with tarfile.open(cache / packed[0]["filename"]) as tar:
            meta = json.load(tar.extractfile("package/package.json"))
            found[url] = tar.extractfile(f"package/{meta.get('jsdelivr') or meta['main']}").read()
    return found


def save(png: bytes, path: Path) -> None:
    """A screenshot, scaled down to WIDTH if wider, as a palette PNG: a UI's few colours keep their look
    and the file a fraction of its size."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    if image.width > WIDTH:
        image = image.resize((WIDTH, round(image.height * WIDTH / image.width)), Image.Resampling.LANCZOS)
    with atomic_path(path) as tmp:
        image.quantize(256, method=Image.Quantize.MEDIANCUT).save(tmp, format="PNG", optimize=True)


# A picture is taken by a function of the browser's page, the UI's address and the toy run: it sets up
# the view, waits until the view shows its content, and returns the screenshot.
Shot = Callable[[Any, str, Toy], bytes]  # (playwright's Page, the UI's address, the toy run)


def runs_table(page, ui: str, toy: Toy) -> bytes:
    """The recipe's runs: its two trainings, each with its evaluations folded under it."""
    _open_runs(page, ui, toy, TRAINING_COLUMNS, unfolded=())
    page.get_by_text(f"train · {RETRAIN[0]}", exact=True).wait_for()
    return _down_to(page, page.get_by_role("row"))


def training_metrics(page, ui: str, toy: Toy) -> bytes:
    """The first training's curves, the metrics that speak of the model and its speed alone."""
    _use_ui(page, ui)
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT + 300})  # two rows of charts, the sidebar's foot below
    page.goto(f"{ui}/#/experiments/{toy.experiment_id}/runs/{toy.training_id}/model-metrics")
    cards = page.get_by_test_id("experiment-view-compare-runs-card")
    cards.first.wait_for()
    for title in [t for t in cards.locator("h4").all_inner_texts() if t not in CURVES]:
        cards.filter(has=page.get_by_title(title, exact=True)).get_by_test_id(
            "experiment-view-compare-runs-card-menu"
        ).click()
        page.get_by_role("menuitem", name="Delete").click()
    page.mouse.move(0, 0)  # no chart's hover toolbar
    for curve in CURVES:
        cards.filter(has=page.get_by_title(curve, exact=True)).locator(".js-plotly-plot").wait_for()
    shot = _down_to(page, cards)
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    return shot


def evaluations(page, ui: str, toy: Toy) -> bytes:
    """The runs unfolded: each training's evaluations under it, with their scores and beam."""
    _open_runs(page, ui, toy, EVALUATION_COLUMNS, unfolded=toy.trainings)
    page.get_by_text(f"· {REDECODE[0]}").wait_for()  # the name of the first training's second evaluation
    return _down_to(page, page.get_by_role("row"))


def registry(page, ui: str, toy: Toy) -> bytes:
    """The registered model: a version a training, and the alias that `transformer promote` set."""
    _use_ui(page, ui)
    page.goto(f"{ui}/#/models/{toy.model}")
    page.get_by_text(f"@ {ALIAS}", exact=True).wait_for()
    return _down_to(page, page.get_by_role("row"))


def _use_ui(page, ui: str, settings: dict | None = None) -> None:
    """Stores the UI's settings for the next view that opens: the model-training UI, its assistant
    closed, and `settings`."""
    page.goto(f"{ui}/health")  # the UI's origin, whose storage the settings go to
    stored = {
        "mlflow.workflowType_v1": json.dumps("machine_learning"),
        "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
        "mlflow.assistant.panelOpen_v1": "false",
    } | (settings or {})
    page.evaluate("s => { for (const [k, v] of Object.entries(s)) localStorage.setItem(k, v); }", stored)


def _open_runs(page, ui: str, toy: Toy, columns: dict[str, int], unfolded: tuple[str, ...]) -> None:
    """The runs table with these columns and widths, the runs in `unfolded` showing their nested runs."""
    view = {
        "selectedColumns": [c for c in columns if c != RUN_NAME],
        "columnOrder": list(columns),  # the columns whose widths apply
        "columnWidths": columns,
        "runsExpanded": {run_id: True for run_id in unfolded},
    }
    key = f'MLflowLocalStorage-1.1-ExperimentPage-["{toy.experiment_id}"]-ReactComponentState'
    _use_ui(page, ui, {key: json.dumps(view)})
    page.goto(f"{ui}/#/experiments/{toy.experiment_id}/runs")


def _down_to(page, content) -> bytes:
    """The window's screenshot, cut a margin below the lowest of `content`'s elements, a moment after
    they show (the UI polls its server all along, so the network never falls quiet to say when)."""
    page.wait_for_timeout(2000)
    size = page.viewport_size
    bottom = max(box["y"] + box["height"] for box in (e.bounding_box() for e in content.all()) if box)
    return page.screenshot(clip={"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], bottom + 12)})


PICTURES: dict[str, Shot] = {
    "mlflow-runs.png": runs_table,
    "mlflow-training-metrics.png": training_metrics,
    "mlflow-evaluations.png": evaluations,
    "mlflow-registry.png": registry,
}
PLOTS = "dvc-plots.png"  # `dvc plots show`'s page


def shoot(toy: Toy, ui: str, plots: Path, scripts: dict[str, bytes], chromium: Path, out: Path) -> None:
    """Every picture into `out`: PICTURES' views of the UI at `ui`, then `plots` with `scripts`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), headless=True)
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        page.set_default_timeout(TIMEOUT_MS)
        page.route("**/*", lambda route: _offline(route, scripts))
        for name, take in PICTURES.items():
            save(take(page, ui, toy), out / name)
            click.echo(out / name, err=True)
        save(_plots_page(page, plots), out / PLOTS)
        click.echo(out / PLOTS, err=True)
        browser.close()


def _plots_page(page, plots: Path) -> bytes:
    """`dvc plots show`'s page, laid out three plots a row: a window a little wider than WIDTH, which
    save() scales down."""
    page.set_viewport_size({"width": 1500, "height": HEIGHT})
    page.goto(plots.as_uri())
    figures = page.locator("body > div")
    for k in range(figures.count()):
        figures.nth(k).locator("canvas, svg").first.wait_for()
    return _down_to(page, figures)


def _offline(route, scripts: dict[str, bytes]) -> None:
    """Answers the page from the loopback UI, local files and `scripts`; nothing else goes out."""
    url = route.request.url
    if url in scripts:
        route.fulfill(body=scripts[url], content_type="text/javascript")
    elif url.startswith(("file:", "http://127.0.0.1:")):
        route.continue_()
    else:
        route.abort()


@click.command()
@click.option("--out", default=ROOT / "docs/images", type=click.Path(path_type=Path), help="the pictures' folder")
@click.option(
    "--workdir",
    type=click.Path(path_type=Path),
    help="where the toy run is made, or reused if it is there (default: a temporary folder, removed)",
)
@click.option("--chromium", default="/usr/bin/chromium", type=click.Path(path_type=Path), help="the browser")
def main(out: Path, workdir: Path | None, chromium: Path) -> None:
    """Runs the toy project and takes the pictures of docs/tracking.md into OUT."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="screenshots-")))
        toy = toy_run(workdir.resolve())
        plots = dvc_plots(toy.repo)
        scripts = npm_scripts(plots, workdir.resolve() / "npm")
        ui = stack.enter_context(mlflow_ui(toy.repo))
        shoot(toy, ui, plots, scripts, chromium, out)


if __name__ == "__main__":
    main()
