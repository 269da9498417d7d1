"""download_corpus from a local mirror or a loopback server: verified, decompressed, all-or-nothing; unsafe archives,
network failures and https-to-http redirects refused with one line."""

from __future__ import annotations

import gzip
import hashlib
import http.client
import http.server
import io
import re
import tarfile
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from transformer.data.download import MIRROR_ENV, download_corpus, load_registry
from transformer.io import DataError, sha256_file

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared/corpora/multi30k"
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
        self.url = URL
        monkeypatch.setenv(MIRROR_ENV, str(self.root))

    def add(self, split: str, lang: str, name: str, data: bytes, sha256: str | None = "auto", **extra) -> None:
        self.put(name, data)
        digest = _sha(data) if sha256 == "auto" else sha256
        self.entry.setdefault(split, {}).setdefault(lang, []).append(
            {"url": f"{self.url}/{name}", "sha256": digest, **extra}
        )

    def put(self, name: str, data: bytes) -> None:
        (self.root / self.corpus / name).write_bytes(data)

    def write_registry(self) -> Path:
        self.registry.write_text(yaml.safe_dump({self.corpus: self.entry}), encoding="utf-8")
        return self.registry

    def download(self) -> dict[str, int]:
        return download_corpus(self.write_registry(), self.corpus, ("de", "en"), self.out)

    def assert_nothing_written(self) -> None:
        assert not self.out.exists()
        leftovers = [p.name for p in self.out.parent.iterdir() if p.name.startswith(f".{self.out.name}.")]
        assert leftovers == []

    def refusal(self, match: str) -> str:
        """The message of the DataError that download() raises, which must match `match`, once it is
        checked that the download wrote nothing."""
        with pytest.raises(DataError, match=match) as e:
            self.download()
        self.assert_nothing_written()
        return str(e.value)


def _response(body: bytes, status: str = "200 OK", length: int | None = None, headers: str = "") -> bytes:
    length = len(body) if length is None else length
    return f"HTTP/1.1 {status}\r\nContent-Length: {length}\r\n{headers}\r\n".encode() + body


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers each path with the raw bytes a test wrote for it: status line, headers and body."""

    def do_GET(self):
        self.server.requests.append(self.path)
        self.wfile.write(self.server.routes.get(self.path, _response(b"", "404 Not Found")))

    def log_message(self, *args):
        pass


class Server(Mirror):
    """The same registry served by a loopback HTTP server instead of a mirror: file <name> at <url>/<name>."""

    def __init__(self, tmp_path: Path, monkeypatch):
        super().__init__(tmp_path, monkeypatch)
        monkeypatch.delenv(MIRROR_ENV)
        monkeypatch.setenv("no_proxy", "127.0.0.1")  # a proxy set for the machine would answer in its place
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.routes: dict[str, bytes] = {}  # path -> the raw response
        self.requests: list[str] = []
        self.httpd.routes, self.httpd.requests = self.routes, self.requests  # what _Handler reads and writes
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def put(self, name: str, data: bytes) -> None:
        self.routes[f"/{name}"] = _response(data)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def mirror(tmp_path, monkeypatch) -> Mirror:
    return Mirror(tmp_path, monkeypatch)


@pytest.fixture
def server(tmp_path, monkeypatch):
    served = Server(tmp_path, monkeypatch)
    yield served
    served.close()


@pytest.fixture
def https(server, monkeypatch) -> Server:
    """The server answers https urls too, without TLS: the redirect rule reads urls, not certificates."""
    monkeypatch.setattr(
        urllib.request.HTTPSHandler, "https_open", lambda h, req: h.do_open(http.client.HTTPConnection, req)
    )
    server.url = server.url.replace("http://", "https://")
    return server


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
    assert "train.en.gz" in mirror.refusal("checksum mismatch")


def test_truncated_gzip_is_refused_and_nothing_written(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    truncated = _gz(EN * 50)[:-30]
    mirror.add("train", "en", "train.en.gz", truncated)  # checksum of the truncated bytes: only gzip can tell
    assert "train.en.gz" in mirror.refusal("truncated or corrupt")


def test_file_missing_from_mirror_names_the_expected_path(mirror):
    mirror.add("train", "de", "train.de.gz", _gz(DE))
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    (mirror.root / mirror.corpus / "train.en.gz").unlink()
    assert str(mirror.root / mirror.corpus / "train.en.gz") in mirror.refusal("not in the mirror")


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
    assert "train.de:2" in mirror.refusal("not valid UTF-8")


def test_one_tsv_file_gives_each_language_its_column(mirror):
    tsv = "".join(f"{de}\t{en}\r\n" for de, en in zip(DE, EN)).encode()
    mirror.add("train", "de", "train.tsv", tsv, format="tsv", column=1)
    mirror.add("train", "en", "train.tsv", tsv, format="tsv", column=2)
    assert mirror.download() == {"train.de": 3, "train.en": 3}
    assert _lines(mirror.out / "train.de") == DE and _lines(mirror.out / "train.en") == EN


def test_a_tsv_line_with_another_number_of_fields_names_the_file_and_line(mirror):
    tsv = f"{DE[0]}\t{EN[0]}\n{DE[1]}\t{EN[1]}\tnote\n{DE[2]}\t{EN[2]}\n".encode()
    mirror.add("train", "de", "train.tsv", tsv, format="tsv", column=1)
    mirror.add("train", "en", "train.tsv", tsv, format="tsv", column=2)
    message = mirror.refusal("3 tab-separated fields, where line 1 has 2")
    assert message.startswith(f"{mirror.root / mirror.corpus / 'train.tsv'}:2: ")


def test_a_tsv_column_beyond_the_fields_is_named(mirror):
    tsv = f"{DE[0]}\t{EN[0]}\n".encode()
    mirror.add("train", "de", "train.tsv", tsv, format="tsv", column=1)
    mirror.add("train", "en", "train.tsv", tsv, format="tsv", column=3)
    mirror.refusal("no column 3: the lines have 2 tab-separated fields")


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
    mirror.refusal("corpus/train.fr")


def test_archive_with_parent_directory_member_is_refused(mirror):
    contents = {"corpus/train.de": "\n".join(DE).encode(), "../evil": b"pwned\n"}
    archive = _tar_gz([tarfile.TarInfo("corpus/train.de"), tarfile.TarInfo("../evil")], contents)
    mirror.add("train", "de", "evil.tgz", archive, member="corpus/train.de")
    mirror.add("train", "en", "train.en.gz", _gz(EN))
    assert "../evil" in mirror.refusal("unsafe")
    assert not (mirror.root.parent / "evil").exists()


def test_archive_with_symlink_member_is_refused(mirror):
    link = tarfile.TarInfo("corpus/train.de")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    contents = {"corpus/train.en": "\n".join(EN).encode()}
    archive = _tar_gz([link, tarfile.TarInfo("corpus/train.en")], contents)
    mirror.add("train", "de", "links.tgz", archive, member="corpus/train.de")
    mirror.add("train", "en", "links.tgz", archive, member="corpus/train.en")
    mirror.refusal("unsafe")


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
    mirror.refusal("no language 'en'")


@pytest.mark.parametrize(
    "sources, message",
    [
        ([{"url": f"{URL}/a.gz"}], "no 'sha256'"),
        ([{"url": f"{URL}/a.gz", "path": "a.gz", "sha256": None}], "exactly one of"),
        ([{"url": f"{URL}/a.gz", "sha256": None, "format": "xml"}], "format 'xml'"),
        ([{"url": f"{URL}/a.tsv", "sha256": None, "format": "tsv"}], "names its `column`"),
        ([{"url": f"{URL}/a.tsv", "sha256": None, "format": "tsv", "column": 0}], "an integer >= 1"),
        ([{"url": f"{URL}/a.txt", "sha256": None, "column": 2}], "other formats none"),
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


def _multi30k_sources() -> list[dict]:
    entry = load_registry(REPO / "transformer/corpora.yaml", "multi30k")
    return [s for langs in entry.values() for srcs in langs.values() for s in srcs]


def test_multi30k_registry_pins_every_source_under_its_own_file_name():
    sources = _multi30k_sources()
    assert len(sources) == 6
    assert all(re.fullmatch("[0-9a-f]{64}", s["sha256"] or "") for s in sources), sources
    assert len({s["url"].rsplit("/", 1)[-1] for s in sources}) == 6  # the mirror holds them by file name


def test_multi30k_registry_checksums_match_the_shared_mirror():
    if not SHARED.exists():
        pytest.skip(
            f"not run: {SHARED} is absent, so the pinned Multi30k digests are unchecked against the real files "
            f"(test_checksum_mismatch_* and test_served_files_* check the verification itself)"
        )
    for source in _multi30k_sources():
        name = source["url"].rsplit("/", 1)[-1]
        assert sha256_file(SHARED / name) == source["sha256"], name


def test_served_files_are_downloaded_and_verified(server):
    server.add("train", "de", "train.de.gz", _gz(DE))
    server.add("train", "en", "train.en.gz", _gz(EN))
    assert server.download() == {"train.de": 3, "train.en": 3}
    assert _lines(server.out / "train.en") == EN
    server.put("train.en.gz", _gz(DE))
    with pytest.raises(DataError, match="checksum mismatch") as e:
        server.download()
    assert str(e.value).startswith(f"{server.url}/train.en.gz: ")


def test_two_urls_ending_in_one_file_name_are_cached_apart(server):
    for split in ("train", "val"):  # val reads each url again, from the cache
        server.add(split, "de", "a/train.gz", _gz(DE))
        server.add(split, "en", "b/train.gz", _gz(EN))
    server.download()
    assert _lines(server.out / "val.de") == DE and _lines(server.out / "val.en") == EN
    assert sorted(server.requests) == ["/a/train.gz", "/b/train.gz"]  # one fetch a url


@pytest.mark.parametrize(
    "response, why",
    [
        (lambda body: _response(body, length=len(body) + 100), "closed after"),
        (lambda body: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100\r\n" + body, "IncompleteRead"),
        (lambda body: b"garbage\r\n\r\n", "BadStatusLine"),
        (lambda body: _response(b"", "404 Not Found"), "404"),
    ],
    ids=["body shorter than Content-Length", "chunk cut short", "malformed status line", "not found"],
)
def test_a_network_error_is_one_line_naming_the_url(server, response, why):
    server.add("train", "de", "train.de.gz", _gz(DE))
    server.add("train", "en", "train.en.gz", _gz(EN))
    server.routes["/train.en.gz"] = response(_gz(EN))
    message = server.refusal(why)
    assert message.startswith(f"{server.url}/train.en.gz: download failed") and "\n" not in message
    assert MIRROR_ENV in message


def test_a_redirect_from_https_to_plain_http_is_refused(https):
    https.add("train", "de", "old/train.de.gz", _gz(DE))
    https.add("train", "en", "train.en.gz", _gz(EN))
    plain = https.url.replace("https://", "http://")
    https.routes["/old/train.de.gz"] = _response(b"", "302 Found", headers=f"Location: {plain}/train.de.gz\r\n")
    https.put("train.de.gz", _gz(DE))
    assert https.refusal("redirected from https to http://").startswith(f"{https.url}/old/train.de.gz: ")
    assert https.requests == ["/old/train.de.gz"]  # the plain-http copy is never asked for


def test_redirects_that_stay_on_https_are_followed(https):
    https.add("train", "de", "old/train.de.gz", _gz(DE))
    https.add("train", "en", "train.en.gz", _gz(EN))
    https.routes["/old/train.de.gz"] = _response(b"", "301 Moved", headers=f"Location: {https.url}/train.de.gz\r\n")
    https.put("train.de.gz", _gz(DE))
    assert https.download() == {"train.de": 3, "train.en": 3}
    assert _lines(https.out / "train.de") == DE
