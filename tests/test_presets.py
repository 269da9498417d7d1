"""Each corpus preset (IWSLT14, WMT14) runs `dvc repro` end to end on a toy mirror of its corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DVC, ROOT, mlflow_runs, project_copy, run, tgz, toy_pairs

from transformer.presets import recipe

pytestmark = pytest.mark.slow


def _xml(lines: list[str], tag: str) -> str:
    """IWSLT/WMT-style SGML: only the <seg> lines are text."""
    segs = "".join(f'<seg id="{i}"> {line} </seg>\n' for i, line in enumerate(lines, 1))
    return f'<{tag} setid="x" srclang="any">\n<doc docid="1" genre="news">\n<p>\n{segs}</p>\n</doc>\n</{tag}>\n'


def _iwslt14_mirror(mirror: Path) -> None:
    """de-en.tgz as fairseq's prepare-iwslt14.sh finds it, with toy sentences."""
    members = {}
    train = toy_pairs(1200, 0)
    for side, lang in enumerate(("de", "en")):
        lines = []
        for talk in range(0, len(train), 300):
            lines += [
                f"<url>http://www.ted.com/talks/talk{talk}.html</url>",
                f"<talkid>{talk}</talkid>",
                "<keywords>talks, toys</keywords>",
                f"<title>Talk {talk}</title>",
            ]
            lines += [pair[side] for pair in train[talk : talk + 300]]
        members[f"de-en/train.tags.de-en.{lang}"] = "\n".join(lines) + "\n"
        for seed, name in enumerate(("TED.dev2010", "TED.tst2010", "TED.tst2011", "TED.tst2012", "TEDX.dev2012"), 1):
            members[f"de-en/IWSLT14.{name}.de-en.{lang}.xml"] = _xml([p[side] for p in toy_pairs(15, seed)], "refset")
    tgz(mirror / "iwslt14" / "de-en.tgz", members)


def _wmt14_mirror(mirror: Path) -> None:
    """The five WMT14 archives of the registry, with toy sentences."""
    train = toy_pairs(1200, 0)
    parts = {
        "training-parallel-europarl-v7.tgz": "training/europarl-v7.de-en",
        "training-parallel-commoncrawl.tgz": "commoncrawl.de-en",
        "training-parallel-nc-v9.tgz": "training/news-commentary-v9.de-en",
    }
    for i, (archive, stem) in enumerate(parts.items()):
        chunk = train[i * 400 : (i + 1) * 400]
        tgz(
            mirror / "wmt14" / archive,
            {f"{stem}.{lang}": "".join(p[side] + "\n" for p in chunk) for side, lang in enumerate(("de", "en"))},
        )
    dev, test = toy_pairs(40, 1), toy_pairs(40, 2)
    tgz(
        mirror / "wmt14" / "dev.tgz",
        {f"dev/newstest2013.{lang}": "".join(p[side] + "\n" for p in dev) for side, lang in enumerate(("de", "en"))},
    )
    tgz(
        mirror / "wmt14" / "test-full.tgz",
        {
            f"test-full/newstest2014-deen-src.{lang}.sgm": _xml([p[side] for p in test], "srcset")
            for side, lang in enumerate(("de", "en"))
        },
    )


def _shrunk(preset: str) -> dict:
    """A preset with the toy sizes: everything else (corpus, direction, test sets, averaging) as shipped."""
    params = recipe(preset, ROOT)
    params["vocab"].update(size=120)
    params["model"].update(N=1, d_model=32, d_ff=64, h=2, dropout=0.0)
    params["train"].update(
        nproc=1,
        max_tokens=400,
        accum=1,
        epochs=2,
        warmup=100,
        factor=1.0,
        save_every=10,
        max_steps=60,
        precision="fp32",
    )
    params["decode"].update(max_len_extra=10)
    return params


@pytest.mark.parametrize(
    "preset, build_mirror, testsets",
    [
        ("iwslt14_de_en", _iwslt14_mirror, {"val", "test"}),
        ("wmt14_en_de_base", _wmt14_mirror, {"val", "test2014"}),
    ],
)
def test_preset_runs_end_to_end_on_a_mirror_of_its_corpus(tmp_path, preset, build_mirror, testsets):
    build_mirror(tmp_path / "mirror")
    repo = project_copy(tmp_path, _shrunk(preset))
    result = run([DVC, "repro"], repo, timeout=600, env={"TRANSFORMER_DATA_MIRROR": str(tmp_path / "mirror")})
    assert "sha256 not pinned" in result.stderr + result.stdout
    scores = json.loads((repo / "reports/scores.json").read_text())
    assert set(scores) == testsets
    data = recipe(preset, ROOT)["data"]
    (evaluation,) = [
        r
        for r in mlflow_runs(repo, f"{data['corpus']}-{data['src_lang']}-{data['tgt_lang']}").values()
        if "mlflow.parentRunId" in r.data.tags
    ]
    assert {k: v for k, v in evaluation.data.metrics.items() if k.endswith("_bleu")} == {
        f"{t}_bleu": s["bleu"] for t, s in scores.items()
    }  # the preset's test sets, scored and logged
    test = sorted(testsets - {"val"})[0]
    raw = repo / "data/raw"
    iwslt = preset.startswith("iwslt")
    # IWSLT14: 1200 sentences and 4 titles (tags dropped, their text kept), every 23rd to val; WMT14: archives joined
    assert len((raw / f"train.{data['src_lang']}").read_text().splitlines()) == (1204 - 1204 // 23 if iwslt else 1200)
    assert "<" not in (raw / f"{test}.{data['tgt_lang']}").read_text()  # only the <seg> text
    translations = (repo / f"data/translations/{test}.txt").read_text().splitlines()
    assert len(translations) == (75 if iwslt else 40)  # IWSLT14: 5 sets of 15
    assert len(list((repo / "reports/figures").glob("*.png"))) == 12
