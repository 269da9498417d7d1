"""docs/own-data.md, run as its reader would: a tiny corpus laid out as its registry says (the train
split one TSV file, the others two plain files each), that registry and those params taken from the
page's own blocks, `dvc repro`, then a translation."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from conftest import BIN, DVC, LEXICON, ROOT, project_copy, run, tiny_params, toy_pairs

PAGE = ROOT / "docs" / "own-data.md"
SPEED = {"train.epochs": 16, "average.last_k": 1, "decode.beam": 1}  # the test's, not the page's: a tiny run


def page_files() -> dict[str, str]:
    """The page's code blocks that name a file (```yaml title="<file>"), file -> text."""
    return dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', PAGE.read_text(encoding="utf-8"), flags=re.S))


def write_corpus(registry: Path, text: str, langs: tuple[str, str], train: list[tuple[str, str]]) -> None:
    """The files the registry `text` names, beside it, then the registry with each `<sha256 of NAME>`
    made NAME's digest: `train` as the train split, toy pairs for the others."""
    entry = next(iter(yaml.safe_load(text).values()))
    for seed, (split, by_lang) in enumerate(entry.items(), 1):
        pairs = train if split == "train" else toy_pairs(20, seed)
        for lang, sources in by_lang.items():
            (source,) = sources
            path = registry.parent / source["path"]
            if source.get("format") == "tsv":
                path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
            else:
                path.write_text("".join(pair[langs.index(lang)] + "\n" for pair in pairs), encoding="utf-8")

    def digest(match: re.Match) -> str:
        return hashlib.sha256((registry.parent / match[1]).read_bytes()).hexdigest()

    registry.write_text(re.sub(r"<sha256 of ([^>]+)>", digest, text), encoding="utf-8")


@pytest.mark.slow
def test_the_own_data_page_trains_on_a_tsv_and_plain_files_filters_the_pairs_and_translates(tmp_path):
    files = page_files()
    page_params = yaml.safe_load(files["params.yaml"])
    params = tiny_params(**SPEED)
    for section, keys in page_params.items():
        params[section] |= keys
    repo = project_copy(tmp_path, params)
    d, t = page_params["data"], page_params["tokenize"]
    assert t["max_ratio"] and t["dedupe"], "the page's example filters are what this test counts"

    unique = list(dict.fromkeys(toy_pairs(500, 0)))
    long = " ".join(["ak"] * math.floor(2 * t["max_ratio"] + 1)) + "."
    uneven = [("kan.", long), (long, "kan."), ("pen.", long)]  # 2 tokens against more than max_ratio times 2
    train = unique[:100] + unique[:5] + [("kan pen.", "")] + uneven + unique[100:]
    registry = repo / d["registry"]
    registry.parent.mkdir(parents=True)
    write_corpus(registry, files[registry.relative_to(repo).as_posix()], (d["src_lang"], d["tgt_lang"]), train)

    run([DVC, "repro"], repo, timeout=600)
    report = json.loads((repo / "reports/tokenize.json").read_text())
    assert report == {
        "train.dropped_empty": 1,
        "train.dropped_long": 0,
        "train.dropped_ratio": 3,
        "train.dropped_duplicate": 5,
        "train.pairs": len(unique),
        "dev.pairs": 20,
        "test.pairs": 20,
    }
    assert set(report) == set(json.loads(files["reports/tokenize.json"])), "the page's example report has other keys"
    column_2 = (repo / f"data/raw/train.{d['tgt_lang']}").read_text(encoding="utf-8").splitlines()
    assert column_2[100:106] == [target for _, target in unique[:5]] + [""]  # the empty field too
    assert set(json.loads((repo / "reports/scores.json").read_text())) == set(page_params["decode"]["testsets"])

    model = "data/model/model.pt"
    translated = run([str(BIN / "transformer"), "translate", "--model", model], repo, input_text="kan pen.\n")
    (line,) = translated.stdout.splitlines()
    words = line.replace(".", " ").split()
    assert words and set(words) <= set(LEXICON.values()), (
        line
    )  # the target side's words: a run this short knows no more
