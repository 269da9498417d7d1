"""Atomic outputs and strict text input: no stage leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from transformer.errors import DataError

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yields a temporary sibling of `path`; renames it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        with _naming(path, tmp):
            yield tmp
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            tmp.chmod(0o666 & ~_UMASK)  # mkstemp makes 0600; outputs get the usual mode
            os.replace(tmp, path)
            _fsync(path.parent)  # the rename itself on disk
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Like atomic_path for a directory output: built aside, synced, swapped in whole. The previous
    output is renamed aside first and removed last, so a kill at any point leaves it whole: in
    place, or aside, where the next write to `path` puts it back before it begins."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed
        shutil.rmtree(stale, ignore_errors=True)
    for old in sorted(path.parent.glob(f".{path.name}.*.old")):  # killed between its two renames
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        with _naming(path, tmp):
            yield tmp
            tmp.chmod(0o777 & ~_UMASK)  # mkdtemp makes 0700; outputs get the usual mode
            _fsync_tree(tmp)
            old = tmp.with_suffix(".old")
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync(path.parent)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Every file and directory under root on disk, so a rename never publishes unwritten data."""
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync(Path(directory))


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _naming(path: Path, tmp: Path) -> Iterator[None]:
    """An OSError while writing (a full disk) names the output, not its temporary file."""
    try:
        yield
    except OSError as e:
        if e.filename is None or str(tmp) in str(e.filename):
            raise OSError(e.errno, f"could not write: {e.strerror or e}", str(path)) from None
        raise


def save_torch(obj: Any, path: Path | str) -> None:
    """torch.save, atomically; a failed write (a full disk) raises its own OSError, not torch's RuntimeError."""
    import torch

    with atomic_path(path) as tmp:
        try:
            with open(tmp, "wb") as f:  # through Python's file, whose write error torch keeps as the context
                torch.save(obj, f)
        except RuntimeError as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise


def write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: Path | str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_json(path: Path | str) -> Any:
    path = _existing(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


def write_lines(path: Path | str, lines: list[str]) -> None:
    """write_text of the lines, each ended by a newline, streamed: not joined into one str first."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def read_lines(path: Path | str) -> list[str]:
    """One entry per line, newline stripped; non-UTF-8 bytes raise DataError with the line number.
    Read a line at a time: the whole file as bytes and again as one str would take three times its
    size at the peak (a WMT14 side is about 700 MB)."""
    return list(iter_lines(path))


def iter_lines(path: Path | str) -> Iterator[str]:
    """read_lines one line at a time, for a file too large to hold as str objects (a WMT14 side's
    4.5M lines take about twice the file's size as a list of str)."""
    path = _existing(path)
    with open(path, "rb") as f:
        yield from _decoded(f, str(path))


def count_lines(path: Path | str) -> int:
    """The number of entries read_lines(path) gives, counted in bytes, without decoding them."""
    path = _existing(path)
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            count, last = count + block.count(b"\n"), block[-1:]
    return count + (last != b"\n")  # a last line without its newline is a line too


def check_aligned(paths: list[Path], counts: list[int], what: str) -> None:
    """Two sides of a parallel `what` (a corpus, a split) must have as many lines: else one DataError
    that names both and their counts."""
    if counts[0] != counts[1]:
        raise DataError(f"{paths[0]}: has {counts[0]} lines, but {paths[1]} has {counts[1]}: the {what} is misaligned")


def _existing(path: Path | str) -> Path:
    """path, which must exist: else one DataError that names it."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: file not found")
    return path


def decode_lines(data: bytes, name: str) -> list[str]:
    """read_lines for bytes already read (stdin); `name` is what an error calls them."""
    return list(_decoded(io.BytesIO(data), name))


def _decoded(raw_lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Lines split at b"\n" only (as str.split("\n")), carriage returns stripped from their ends."""
    offset = 0
    for number, raw in enumerate(raw_lines, 1):
        try:
            yield raw.decode("utf-8").removesuffix("\n").rstrip("\r")
        except UnicodeDecodeError as e:  # "\n" is never inside a UTF-8 sequence: a line holds a bad one whole
            where = f"byte {raw[e.start]:#04x} at offset {offset + e.start}"
            raise DataError(f"{name}:{number}: not valid UTF-8 ({where})") from None
        offset += len(raw)


def sha256_file(path: Path | str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
