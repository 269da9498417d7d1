"""How a checkpoint reaches the disk: written by the training thread itself, or, on a GPU, from a copy
in host memory by a thread of its own while the training goes on.

A synchronous save of a large model leaves the GPU idle while the host serializes the weights and
Adam's state and the disk syncs them. The background writer holds the training up only for the copy
to host memory. The file is written as every checkpoint is (checkpoints.save, atomic), and the old
checkpoints are pruned only once the new one is whole on disk, so a kill at any instant leaves the
newest complete checkpoint for a rerun to resume from. On a CPU the training's own threads keep every
core busy, so a writer thread would take its time from them, and the copy would double the memory
the state takes: a CPU run writes in the training thread, as it always has."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from transformer import checkpoints


def writer_for(device: torch.device) -> Writer:
    """The writer for a training on `device`: in the background on a GPU, in the training thread elsewhere."""
    return BackgroundWriter(device) if device.type == "cuda" else Writer()


class Writer:
    """Writes each checkpoint in the thread that saves it, which waits for the disk. A `with` block of
    a writer leaves only once no write is in flight, however it leaves."""

    def write(self, path: Path, live: dict[str, Any], fixed: dict[str, Any], after: Callable[[], None]) -> None:
        """Writes the checkpoint `live | fixed` at `path`, then calls `after` (the pruning). `live` holds
        the training's own state dicts, whose tensors the next update changes in place; `fixed` the
        rest, built for this checkpoint and left unchanged after."""
        checkpoints.save(path, live | fixed)
        after()

    def wait(self) -> None:
        """Returns once the last write is whole on disk, and raises its error if it failed; a write in
        the training thread has done both by the time it returns."""

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None:
            self.wait()
            return
        try:  # the error that ends the training goes on; the write in flight still ends whole
            self.wait()
        except Exception as failed:
            error.add_note(f"The checkpoint write in flight failed too: {failed}")


class BackgroundWriter(Writer):
    """Writes each checkpoint from a snapshot in host memory, in a thread of its own, so the training
    waits only for the copy. One write is in flight at most: the next write and wait() wait for it,
    and raise its error, if it failed, in the training thread."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.UntypedStorage] = []  # the last snapshot's storages, for the next one to reuse
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._failure: BaseException | None = None

    def write(self, path: Path, live: dict[str, Any], fixed: dict[str, Any], after: Callable[[], None]) -> None:
        self.wait()  # the buffers the snapshot reuses are free once the last write is on disk
        checkpoint = self._snapshot(live) | fixed
        # Not a daemon: an interpreter that exits on an error nothing caught still finishes the file.
        thread = threading.Thread(target=self._run, args=(path, checkpoint, after), name="checkpoint writer")
        self._path, self._thread = path, thread
        thread.start()

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        failure, self._thread, self._failure = self._failure, None, None
        if failure is not None:
            failure.add_note(f"raised while {self._path} was written in the background")
            raise failure

    def _run(self, path: Path, checkpoint: dict[str, Any], after: Callable[[], None]) -> None:
        try:
            checkpoints.save(path, checkpoint)
            after()  # only now that the new checkpoint is whole may the old ones go
        except BaseException as e:  # for wait() to raise in the training thread
            self._failure = e

    def _snapshot(self, live: dict[str, Any]) -> dict[str, Any]:
        """`live` copied to host memory: on a GPU into pinned buffers, the copies queued behind the
        update that made the state and waited for once."""
        cuda = self.device.type == "cuda"
        old, self._buffers = iter(self._buffers), []

        def to_host(storage: torch.UntypedStorage) -> torch.UntypedStorage:
            buffer = next(old, None)
            if buffer is None or buffer.nbytes() != storage.nbytes():
                buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda).untyped_storage()
            self._buffers.append(buffer)
            return buffer.copy_(storage, non_blocking=cuda)

        snapshot = host_snapshot(live, to_host)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return snapshot


def host_snapshot(tree: Any, to_host: Callable[[torch.UntypedStorage], torch.UntypedStorage]) -> Any:
    """`tree` (state dicts: dicts, lists and tuples of tensors, numbers and strings) with every tensor's
    storage copied by `to_host` once, however many tensors view it, and each tensor a view of that copy
    at its own offset, size and stride. Tied weights thus stay one storage, and torch.save writes the
    snapshot byte for byte as it would have written `tree`. The containers are copied as
    copy.deepcopy copies them; numbers and strings, which nothing changes in place, are shared."""
    copies: dict[int, torch.UntypedStorage] = {}
    memo: dict[int, Any] = {}  # deepcopy's: id of an original -> its copy
    for t in _tensors(tree):
        storage = t.untyped_storage()
        if storage._cdata not in copies:  # the storage's own address, which torch.save keys storages by
            copies[storage._cdata] = to_host(storage)
        view = torch.empty(0, dtype=t.dtype).set_(copies[storage._cdata], t.storage_offset(), t.size(), t.stride())
        memo[id(t)] = view
    return copy.deepcopy(tree, memo)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)
