"""The process's memory: its peak, and glibc's allocator tuned for training on CPUs (freed blocks
kept for the next update, and handed back to the system every so often)."""

from __future__ import annotations

import functools
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (<malloc.h>)


def keep_freed_memory(keep: bool = True) -> bool:
    """glibc: serve every allocation from the heap and keep what is freed there for reuse.

    By default glibc maps each block over its mmap threshold (at most 32 MiB) afresh and unmaps it
    when freed. A CPU update's activations and logits are such blocks, hundreds of MB of them, so
    every update would fault its memory in anew, in the kernel. Kept, the freed blocks of one update
    serve the next (bench/bench.py times it: rows t and u against c and e; docs/speed.md), at the
    cost of a resident set that holds the largest update's blocks.
    `keep=False` goes back to glibc's defaults, with the mmap threshold where glibc's own
    adjustment would take it for blocks this large. True where glibc took the settings.
    Only the main arena keeps blocks of 64 MiB and more: glibc maps them afresh in its other
    arenas (other threads', and the main thread's after an allocation failed), whatever mallopt says."""
    libc = _glibc()
    if libc is None:
        return False
    if keep:
        settings = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: 2**31 - 1}
    else:
        settings = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 32 * 1024 * 1024}
    applied = all(libc.mallopt(key, value) == 1 for key, value in settings.items())
    if not keep:
        release_freed_memory()
    return applied


def release_freed_memory() -> None:
    """glibc: gives the free pages of the heap back to the system (malloc_trim). Kept memory
    fragments as batch shapes change and would grow over a run; released every RELEASE_EVERY
    updates, its pages fault in again once per RELEASE_EVERY updates, not every update."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_rss_mb() -> float:
    """The most memory this process has held resident so far (VmHWM), in MiB."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    return kib / (1024 * 1024 if sys.platform == "darwin" else 1024)


@functools.cache
def _glibc():
    """The C library this process runs on, where it is glibc (mallopt and malloc_trim are its own); else None.
    Looked up once: platform.libc_ver reads the interpreter's binary."""
    import ctypes
    import platform

    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None
