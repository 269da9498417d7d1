"""Fetches a registered corpus (from its URL or a local mirror), verifies it, writes plain text."""

from __future__ import annotations

import gzip
import hashlib
import html
import http.client
import io
import os
import re
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import yaml

from transformer.config import NAME
from transformer.io import DataError, atomic_dir, sha256_file

MIRROR_ENV = "TRANSFORMER_DATA_MIRROR"
FORMATS = ("text", "tags", "sgm", "tsv")  # tsv: one `column` (from 1) of tab-separated fields
SELECTORS = ("keep_every", "drop_every")  # keep_every: n keeps lines n, 2n, ...; drop_every: n keeps the others
MAX_BYTES = 4 << 30  # a source's size once decompressed: beyond, a decompression bomb or not the registered file
MAX_ARCHIVE_BYTES = 16 << 30  # the same for a whole tar archive, read through to find a member
MAX_MEMBERS = 100_000
_SEG = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)
_TAG_LINES = ("<url>", "<talkid>", "<keywords>")  # TED metadata lines that fairseq's prepare-iwslt14.sh drops
_TAGS_KEPT = re.compile(r"</?(title|description)>")  # ... and tags it strips, keeping their text


def load_registry(path: Path | str, corpus: str) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The entry for `corpus`: split -> language -> sources, with local paths made absolute."""
    path = Path(path)
    try:
        registry = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise DataError(f"{path}: corpus registry not found (params data.registry)") from None
    except yaml.YAMLError as e:
        raise DataError(f"{path}: not valid YAML: {e}") from None
    if corpus not in registry:
        raise DataError(f"{path}: no corpus '{corpus}' (registered: {', '.join(registry) or 'none'})")
    entry = registry[corpus]
    for split, langs in entry.items():
        for lang, sources in langs.items():
            where = f"{path}: {corpus}.{split}.{lang}"
            if not all(isinstance(name, str) and NAME.fullmatch(name) for name in (split, lang)):
                raise DataError(
                    f"{where}: split and language names become file names: letters, digits, "
                    f"'_', '.' and '-' only, not starting with '.' or '-'"
                )
            if not isinstance(sources, list) or not sources:
                raise DataError(f"{where}: expected a non-empty list of sources")
            for s in sources:
                _check_source(s, where, path.parent)
    return entry


def _check_source(source: dict[str, Any], where: str, base: Path) -> None:
    if ("url" in source) == ("path" in source):
        raise DataError(f"{where}: each source needs exactly one of 'url' or 'path'")
    if "sha256" not in source:
        raise DataError(f"{where}: source {source.get('url') or source.get('path')} has no 'sha256' key")
    if source.get("format", "text") not in FORMATS:
        raise DataError(f"{where}: format '{source['format']}' is not one of {', '.join(FORMATS)}")
    tsv, column = source.get("format") == "tsv", source.get("column")
    if tsv != ("column" in source) or tsv and (type(column) is not int or column < 1):
        raise DataError(f"{where}: a source of format tsv names its `column`, an integer >= 1; other formats none")
    every = [k for k in SELECTORS if k in source]
    if len(every) > 1 or any(type(source[k]) is not int or source[k] < 2 for k in every):
        raise DataError(f"{where}: at most one of {', '.join(SELECTORS)}, an integer >= 2")
    if "url" in source:
        url = str(source["url"])
        if not url.startswith("https://") and not (url.startswith("http://") and source["sha256"]):
            raise DataError(f"{where}: {url}: use https, or pin the sha256 of a plain-http download")
        if not NAME.fullmatch(_basename(url)):
            raise DataError(f"{where}: {url}: the file name it ends with is not a safe file name")
    if "path" in source:
        source["path"] = str((base / source["path"]).resolve())


def download_corpus(registry: Path | str, corpus: str, langs: tuple[str, str], out_dir: Path | str) -> dict[str, int]:
    """Writes out_dir/<split>.<lang> for every split of `corpus`; returns line counts.

    The directory appears only when every file is fetched and verified."""
    entry = load_registry(registry, corpus)
    mirror = os.environ.get(MIRROR_ENV)
    counts = {}
    with tempfile.TemporaryDirectory(prefix="transformer-download-") as cache, atomic_dir(out_dir) as tmp:
        fetched: dict[str, Path] = {}  # one fetch per archive, however many members are read
        for split, by_lang in entry.items():
            for lang in langs:
                if lang not in by_lang:
                    raise DataError(f"{registry}: corpus '{corpus}' split '{split}' has no language '{lang}'")
                lines = []
                for source in by_lang[lang]:
                    local = _fetch(source, corpus, mirror, Path(cache), fetched)
                    lines.extend(_read_source(local, source))
                (tmp / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
                counts[f"{split}.{lang}"] = len(lines)
    return counts


def _fetch(source: dict[str, Any], corpus: str, mirror: str | None, cache: Path, fetched: dict[str, Path]) -> Path:
    key = source.get("url") or source["path"]
    if key in fetched:
        return fetched[key]
    if "path" in source:
        local = where = Path(source["path"])
        if not local.exists():
            raise DataError(f"{local}: corpus file not found")
    elif mirror:
        local = where = Path(mirror) / corpus / _basename(key)
        if not local.exists():
            raise DataError(
                f"{local}: not in the mirror ({MIRROR_ENV}={mirror}); expected <mirror>/{corpus}/{local.name}"
            )
    else:  # a folder per url: two urls may end in one file name
        where, local = key, cache / hashlib.sha256(key.encode()).hexdigest()[:16] / _basename(key)
        _http_get(key, local)
    _verify(local, source["sha256"], where)
    fetched[key] = local
    return local


def _basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _http_get(url: str, dest: Path) -> None:
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.build_opener(_NoDowngrade(url)).open(url, timeout=60) as response, open(dest, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, file=sys.stderr) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
            if total and f.tell() != total:  # read in chunks, http.client ends a short body without a word
                raise ConnectionError(f"the connection closed after {f.tell():,} of {total:,} bytes")
    except (OSError, http.client.HTTPException) as e:  # repr: one line, and it names the kind of failure
        raise DataError(f"{url}: download failed ({e!r}); retry, or set {MIRROR_ENV} to a local mirror") from None


class _NoDowngrade(urllib.request.HTTPRedirectHandler):
    """Follows redirects, except from https to plain http, where the bytes would no longer be authenticated."""

    def __init__(self, url: str):
        self.url = url

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(req.full_url).scheme == "https" and urllib.parse.urlsplit(newurl).scheme != "https":
            fp.close()
            raise DataError(
                f"{self.url}: redirected from https to {newurl}; refused, a download never drops to plain http "
                f"(register a url that stays on https, or set {MIRROR_ENV} to a local mirror)"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _verify(path: Path, expected: str | None, where: Path | str) -> None:
    actual = sha256_file(path)
    if expected is None:
        print(f"warning: {where}: sha256 not pinned in the registry; it is {actual}", file=sys.stderr)
    elif actual != expected:
        raise DataError(f"{where}: checksum mismatch: sha256 is {actual}, the registry expects {expected}")


def _read_source(path: Path, source: dict[str, Any]) -> list[str]:
    member = source.get("member")
    data = _tar_member(path, member) if member else None
    name = f"{path}:{member}" if member else str(path)
    if (member or path.name).endswith(".gz"):
        data = _gunzip(gzip.GzipFile(fileobj=io.BytesIO(data)) if member else gzip.open(path), name)
    elif data is None:
        data = path.read_bytes()  # not compressed: as large as it looks
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(f"{name}:{line}: not valid UTF-8") from None
    lines = text.split("\n")  # only newlines: U+2028 and friends may sit inside a sentence
    if lines and lines[-1] == "":
        lines.pop()
    fmt = source.get("format", "text")
    if fmt == "tags":  # TED transcripts between metadata lines, as fairseq's prepare-iwslt14.sh reads them
        lines = [_TAGS_KEPT.sub("", line) for line in lines if not any(tag in line for tag in _TAG_LINES)]
    elif fmt == "sgm":
        lines = [html.unescape(m.group(1)) for m in map(_SEG.search, lines) if m]
    elif fmt == "tsv":
        lines = _column(lines, source["column"], name)
    if "keep_every" in source:  # fairseq's awk 'NR % n == 0'
        lines = lines[source["keep_every"] - 1 :: source["keep_every"]]
    elif "drop_every" in source:
        n = source["drop_every"]
        lines = [line for i, line in enumerate(lines, 1) if i % n]
    return [line.strip() for line in lines]


def _column(lines: list[str], column: int, name: str) -> list[str]:
    """Field `column` (from 1) of each tab-separated line. Every line has as many fields as the first:
    a tab inside a sentence, or a missing side, would otherwise shift a pair out of line unseen."""
    out: list[str] = []
    width = None
    for number, line in enumerate(lines, 1):
        fields = line.split("\t")
        width = width or len(fields)
        if len(fields) != width:
            raise DataError(f"{name}:{number}: {len(fields)} tab-separated fields, where line 1 has {width}")
        if column > width:
            raise DataError(f"{name}:{number}: no column {column}: the lines have {width} tab-separated fields")
        out.append(fields[column - 1])
    return out


def _gunzip(stream: gzip.GzipFile, name: str) -> bytes:
    """Decompresses at most MAX_BYTES; more is refused before it fills memory."""
    try:
        with stream:
            data = stream.read(MAX_BYTES + 1)
    except (EOFError, OSError, zlib.error) as e:
        raise DataError(f"{name}: truncated or corrupt gzip ({e})") from None
    if len(data) > MAX_BYTES:
        raise DataError(
            f"{name}: decompresses to more than {MAX_BYTES:,} bytes (transformer.data.download.MAX_BYTES): "
            f"a decompression bomb, or not the file the registry means"
        )
    return data


def _tar_member(archive: Path, member: str) -> bytes:
    """Reads one member, after refusing archives whose members could escape an output directory."""
    try:
        with tarfile.open(archive) as tar:
            for count, info in enumerate(tar, 1):
                _check_member(archive, info, count)
            try:
                f = tar.extractfile(member)
            except KeyError:
                f = None
            if f is None:
                raise DataError(f"{archive}: archive has no file '{member}'")
            return f.read()
    except (tarfile.TarError, EOFError, zlib.error) as e:
        raise DataError(f"{archive}: truncated or corrupt archive ({e})") from None


def _check_member(archive: Path, info: tarfile.TarInfo, count: int) -> None:
    unsafe = info.name.startswith(("/", "\\")) or ".." in Path(info.name).parts
    if unsafe or info.issym() or info.islnk() or info.isdev():
        kind = "a link" if info.issym() or info.islnk() else "a device" if info.isdev() else "a path"
        raise DataError(f"{archive}: unsafe archive member '{info.name}' ({kind} escaping the output directory)")
    too_big = info.size > MAX_BYTES or info.offset_data + info.size > MAX_ARCHIVE_BYTES or count > MAX_MEMBERS
    if too_big:
        raise DataError(
            f"{archive}: member '{info.name}' takes the archive past its caps ({MAX_BYTES:,} bytes a member, "
            f"{MAX_ARCHIVE_BYTES:,} in all, {MAX_MEMBERS:,} members; transformer.data.download): "
            f"a decompression bomb, or not the file the registry means"
        )
