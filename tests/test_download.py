"""download_corpus from a local mirror: verified, decompressed, all-or-nothing; unsafe archives refused."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path

import pytest
import yaml

from transformer.download import MIRROR_ENV, download_corpus, load_registry
from transformer.io import DataError

REPO = Path(__file__).resolve().parents[1]
SHARED_SUMS = Path(__file__).resolve().parents[2] / "shared/corpora/multi30k/SHA256SUMS"
URL = "https://example.org/corpus"

DE = ["Ein Hund läuft.", "Zwei Männer spielen Fußball.", "Eine Frau liest."]
EN = ["A dog runs.", "Two men play soccer.", "A woman reads."]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _gz(lines: list[str]) -> bytes:
    return gzip.compress("".join(line + "\n" for line in lines).encode("utf-8"), mtime=0)


def _tar_gz(members: list[tarfile.TarInfo], contents: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info in members:
            data = contents.get(info.name)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


class Mirror:
    """<root>/<corpus>/<file> plus a registry whose url entries point at those files by basename."""

    def __init__(self, tmp_path: Path, monkeypatch, corpus: str = "tiny"):
        self.root, self.corpus = tmp_path / "mirror", corpus
        (self.root / corpus).mkdir(parents=True)
        self.registry = tmp_path / "corpora.yaml"
        self.entry: dict = {}
        self.out = tmp_path / "raw"
        monkeypatch.setenv(MIRROR_ENV, str(self.root))

    def add(self, split: str, lang: str, name: str, data: bytes, sha256: str | None = "auto", **extra) -> Path:
        path = self.root / self.corpus / name
        path.write_bytes(data)
        digest = _sha(data) if sha256 == "auto" else sha256
        self.entry.setdefault(split, {}).setdefault(lang, []).append(
            {"url": f"{URL}/{name}", "sha256": digest, **extra}
        )
        return path

    def write_registry(self) -> Path:
        self.registry.write_text(yaml.safe_dump({self.corpus: self.entry}), encoding="utf-8")
        return self.registry

    def download(self) -> dict[str, int]:
        return download_corpus(self.write_registry(), self.corpus, ("de", "en"), self.out)

    def assert_nothing_written(self) -> None:
        assert not self.out.exists()
        leftovers = [p.name for p in self.out.parent.iterdir() if p.name.startswith(f".{self.out.name}.")]
        assert leftovers == []


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Mirror:
    return Mirror(tmp_path, monkeypatch)


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def test_mirror_files_come_out_decompressed_with_their_line_counts(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    mirror.add("val", "de", "val.de.gz", _gz(DE[:2]))
    mirror.add("val", "en", "val.en.gz", _gz(EN[:2]))
    counts = mirror.download()
    assert counts == {"train.de": 3, "train.en": 3, "val.de": 2, "val.en": 2}
    assert sorted(p.name for p in mirror.out.iterdir()) == ["train.de", "train.en", "val.de", "val.en"]
    assert _lines(mirror.out / "train.de") == DE
    assert _lines(mirror.out / "val.en") == EN[:2]


def test_sources_of_a_split_are_concatenated_in_order(mirror):
    mirror.add("train", "de", "a.de", "\n".join(DE[:1]).encode() + b"\n")
    mirror.add("train", "de", "b.de.gz", _gz(DE[1:]))
    mirror.add("train", "en", "a.en.gz", _gz(EN))
    mirror.download()
    assert _lines(mirror.out / "train.de") == DE


def test_lines_split_only_at_newlines_so_both_sides_stay_aligned(mirror):
    # U+2028, U+0085 and form feed are ordinary characters inside a sentence of a
    # line-aligned corpus; str.splitlines() would split there and misalign the sides.
    de = ["Er sagte:\u2028Ja.", "Seite\x0cZwei", "Ende\x85gut"]
    mirror.add("train", "de", "train.de.gz", _gz(de))
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    counts = mirror.download()
    assert counts["train.de"] == counts["train.en"] == 3
    assert _lines(mirror.out / "train.de") == de


def test_crlf_line_ends_are_removed(mirror):
    mirror.add("train", "de", "train.de", "".join(line + "\r\n" for line in DE).encode())
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    mirror.download()
    assert _lines(mirror.out / "train.de") == DE


def test_checksum_mismatch_names_the_file_and_writes_nothing(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    mirror.add("train", "en", "train.en.gz", _gz(EN), sha256=_sha(b"something else"))
    with pytest.raises(DataError, match="checksum mismatch") as e:
        mirror.download()
    assert "train.en.gz" in str(e.value)
    mirror.assert_nothing_written()


def test_truncated_gzip_is_refused_and_nothing_written(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    truncated = _gz(EN * 50)[:-30]
    mirror.add("train", "en", "train.en.gz", truncated)  # checksum of the truncated bytes: only gzip can tell
    with pytest.raises(DataError, match="truncated or corrupt") as e:
        mirror.download()
    assert "train.en.gz" in str(e.value)
    mirror.assert_nothing_written()


def test_file_missing_from_mirror_names_the_expected_path(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    (mirror.root / mirror.corpus / "train.en.gz").unlink()
    with pytest.raises(DataError, match="not in the mirror") as e:
        mirror.download()
    assert str(mirror.root / mirror.corpus / "train.en.gz") in str(e.value)
    mirror.assert_nothing_written()


def test_failure_keeps_a_previous_output_directory(mirror):
    mirror.out.mkdir()
    (mirror.out / "train.de").write_text("old\n", encoding="utf-8")
    mirror.add("train", "de", "train.de.gz", _gz(DE), sha256="0" * 64)
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    with pytest.raises(DataError):
        mirror.download()
    assert (mirror.out / "train.de").read_text(encoding="utf-8") == "old\n"


def test_non_utf8_source_names_file_and_line(mirror):
    mirror.add("train", "de", "train.de", b"gut\nschlecht \xff\n")
    mirror.add("train", "en", "train.en.gz", _gz(EN[:2]))
    with pytest.raises(DataError, match="not valid UTF-8") as e:
        mirror.download()
    assert "train.de:2" in str(e.value)
    mirror.assert_nothing_written()


def test_archive_member_is_read(mirror):
    contents = {"corpus/train.de": "\n".join(DE).encode(), "corpus/train.en": "\n".join(EN).encode()}
    archive = _tar_gz([tarfile.TarInfo(name) for name in contents], contents)
    mirror.add("train", "de", "corpus.tgz", archive, member="corpus/train.de")
    mirror.add("train", "en", "corpus.tgz", archive, member="corpus/train.en")
    assert mirror.download() == {"train.de": 3, "train.en": 3}
    assert _lines(mirror.out / "train.en") == EN


def test_archive_member_that_is_absent_is_named(mirror):
    contents = {"corpus/train.de": b"x\n"}
    archive = _tar_gz([tarfile.TarInfo("corpus/train.de")], contents)
    mirror.add("train", "de", "corpus.tgz", archive, member="corpus/train.de")
    mirror.add("train", "en", "corpus.tgz", archive, member="corpus/train.fr")
    with pytest.raises(DataError, match="corpus/train.fr"):
        mirror.download()
    mirror.assert_nothing_written()


def test_archive_with_parent_directory_member_is_refused(mirror):
    contents = {"corpus/train.de": "\n".join(DE).encode(), "../evil": b"pwned\n"}
    archive = _tar_gz([tarfile.TarInfo("corpus/train.de"), tarfile.TarInfo("../evil")], contents)
    mirror.add("train", "de", "evil.tgz", archive, member="corpus/train.de")
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    with pytest.raises(DataError, match="unsafe") as e:
        mirror.download()
    assert "../evil" in str(e.value)
    mirror.assert_nothing_written()
    assert not (mirror.root.parent / "evil").exists()


def test_archive_with_symlink_member_is_refused(mirror):
    link = tarfile.TarInfo("corpus/train.de")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    contents = {"corpus/train.en": "\n".join(EN).encode()}
    archive = _tar_gz([link, tarfile.TarInfo("corpus/train.en")], contents)
    mirror.add("train", "de", "links.tgz", archive, member="corpus/train.de")
    mirror.add("train", "en", "links.tgz", archive, member="corpus/train.en")
    with pytest.raises(DataError, match="unsafe"):
        mirror.download()
    mirror.assert_nothing_written()


def test_local_path_sources_are_resolved_next_to_the_registry(tmp_path, monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    local = tmp_path / "files"
    local.mkdir()
    de, en = _gz(DE), "\n".join(EN).encode() + b"\n"
    (local / "train.de.gz").write_bytes(de)
    (local / "train.en").write_bytes(en)
    registry = tmp_path / "corpora.yaml"
    registry.write_text(
        yaml.safe_dump(
            {
                "local": {
                    "train": {
                        "de": [{"path": "files/train.de.gz", "sha256": _sha(de)}],
                        "en": [{"path": "files/train.en", "sha256": _sha(en)}],
                    }
                }
            }
        ),
        encoding="utf-8",
    )
    counts = download_corpus(registry, "local", ("de", "en"), tmp_path / "raw")
    assert counts == {"train.de": 3, "train.en": 3}
    assert _lines(tmp_path / "raw" / "train.de") == DE
    assert load_registry(registry, "local")["train"]["de"][0]["path"] == str(local / "train.de.gz")


def test_missing_local_path_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(MIRROR_ENV, raising=False)
    registry = tmp_path / "corpora.yaml"
    registry.write_text(
        yaml.safe_dump(
            {
                "local": {
                    "train": {
                        "de": [{"path": "nowhere.de", "sha256": None}],
                        "en": [{"path": "nowhere.en", "sha256": None}],
                    }
                }
            }
        ),
        encoding="utf-8",
    )
    with pytest.raises(DataError, match="not found") as e:
        download_corpus(registry, "local", ("de", "en"), tmp_path / "raw")
    assert "nowhere.de" in str(e.value)
    assert not (tmp_path / "raw").exists()


def test_unpinned_checksum_warns_with_the_digest_and_still_works(mirror, capsys):
    data = _gz(DE)
    mirror.add("train", "de", "train.de.gz", data, sha256=None)
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    assert mirror.download()["train.de"] == 3
    err = capsys.readouterr().err
    assert "warning" in err and "train.de.gz" in err and _sha(data) in err
    assert "train.en.gz" not in err  # a pinned file gives no warning


def test_missing_language_in_a_split_is_named(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    with pytest.raises(DataError, match="no language 'en'"):
        mirror.download()
    mirror.assert_nothing_written()


@pytest.mark.parametrize(
    "sources, message",
    [
        ([{"url": f"{URL}/a.gz"}], "no 'sha256'"),
        ([{"url": f"{URL}/a.gz", "path": "a.gz", "sha256": None}], "exactly one of"),
        ([{"url": f"{URL}/a.gz", "sha256": None, "format": "xml"}], "format 'xml'"),
        ([], "non-empty list"),
    ],
)
def test_malformed_registry_entry_is_refused(tmp_path, sources, message):
    registry = tmp_path / "corpora.yaml"
    registry.write_text(yaml.safe_dump({"c": {"train": {"de": sources}}}), encoding="utf-8")
    with pytest.raises(DataError, match=message) as e:
        load_registry(registry, "c")
    assert "c.train.de" in str(e.value)


def test_unknown_corpus_lists_the_registered_ones():
    with pytest.raises(DataError, match="no corpus 'nope'") as e:
        load_registry(REPO / "transformer/corpora.yaml", "nope")
    assert "multi30k" in str(e.value)


def test_multi30k_registry_checksums_match_the_shared_mirror():
    if not SHARED_SUMS.exists():
        pytest.skip(f"{SHARED_SUMS} not present (no local Multi30k mirror)")
    pinned = {}
    for line in SHARED_SUMS.read_text(encoding="utf-8").splitlines():
        digest, name = line.split()
        pinned[name] = digest
    entry = load_registry(REPO / "transformer/corpora.yaml", "multi30k")
    sources = [s for langs in entry.values() for srcs in langs.values() for s in srcs]
    assert len(sources) == 6
    for source in sources:
        name = source["url"].rsplit("/", 1)[-1]
        assert source["sha256"] == pinned[name], name
