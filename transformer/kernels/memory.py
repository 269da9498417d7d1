"""The process's memory: its allocator, its peak, and glibc's allocator tuned for training on CPUs
where mimalloc is not at hand (freed blocks kept for the next update, and handed back to the system
every so often).

Training's blocks change size with every batch's shape. glibc's heap keeps the freed ones, and
they fragment: the resident set grows to several times what an update holds live. mimalloc,
installed with the project (the cmeel-mimalloc wheel), serves blocks by size class, so freed
blocks serve the next update's without the heap growing. It must be in place before the process
allocates, so the train stage (and bench.py) run themselves again with it preloaded
(preload_allocator). Before that they limit oneDNN's cache of built kernels, whose default held
more memory than the model's updates (training_memory does both)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (<malloc.h>)
ALLOCATOR_ENV = "TRANSFORMER_ALLOCATOR"  # "glibc": stay on glibc's malloc (comparisons); else mimalloc where installed
_MIMALLOC = ("cmeel-mimalloc", "cmeel.prefix/lib/libmimalloc.so")  # the wheel, and the library's place in it
# mimalloc's options, unless the environment sets them. Purge delay (ms): never. Its size classes
# keep the freed pages few, and an update reuses them at once; returned to the system, each would
# fault in again, the cost glibc's kept heap avoided. Transparent huge pages: off. Asked for them,
# the kernel clears 2 MiB at every first touch of an arena's pages, which an update's large fp32
# blocks kept doing, and the resident set rounds up to them (docs/speed.md).
MIMALLOC_OPTIONS = {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ALLOW_THP": "0"}
# oneDNN's cache of built kernels (its capacity, unless the environment sets it): one kernel per op
# and shape (a CPU's bf16 matmuls), about half a MB each. Attention's shapes change with every batch,
# so oneDNN's default 1,024 fills with kernels rarely used again; 512 still keeps those the updates
# reuse (PaddedLinear's row buckets above all), which a smaller cache would rebuild (docs/speed.md).
KERNEL_CACHE_ENV, KERNEL_CACHE, ONEDNN_KERNEL_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY", 512, 1024


def training_memory() -> None:
    """A training process's memory, set up first thing (the train stage, bench.py): oneDNN's kernel
    cache limited, then mimalloc preloaded where it is installed (the process is replaced)."""
    os.environ.setdefault(KERNEL_CACHE_ENV, str(KERNEL_CACHE))  # oneDNN reads it at its first kernel
    preload_allocator()


def kernel_cache() -> int:
    """The capacity of oneDNN's kernel cache in this process: the environment's, else oneDNN's default."""
    return int(os.environ.get(KERNEL_CACHE_ENV, ONEDNN_KERNEL_CACHE))


def preload_allocator() -> None:
    """Runs this process again, with the same command line, with mimalloc preloaded: where it is
    installed and not yet in place, and TRANSFORMER_ALLOCATOR does not ask for glibc. Elsewhere it
    returns and the process goes on with its C library's malloc. Call it first thing: the process is
    replaced (same PID, so a launcher such as torchrun keeps track of it)."""
    lib = mimalloc_library()
    preloaded = os.environ.get("LD_PRELOAD", "")
    if lib is None or os.environ.get(ALLOCATOR_ENV) == "glibc" or str(lib) in preloaded or allocator() == "mimalloc":
        return  # the check on LD_PRELOAD: a library the loader refused is not asked for again
    preload = " ".join(filter(None, [str(lib), preloaded]))
    env = MIMALLOC_OPTIONS | os.environ | {"LD_PRELOAD": preload}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def mimalloc_library() -> Path | None:
    """The mimalloc shared library of the installed cmeel-mimalloc wheel (Linux); None without it."""
    from importlib import metadata

    try:
        lib = Path(metadata.distribution(_MIMALLOC[0]).locate_file(_MIMALLOC[1]))
    except metadata.PackageNotFoundError:
        return None
    return lib if sys.platform == "linux" and lib.is_file() else None


@functools.cache
def allocator() -> str:
    """The malloc this process runs on: "mimalloc" where it is loaded, else "glibc" or "system"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if "libmimalloc" in maps:
        return "mimalloc"
    return "glibc" if _glibc() is not None else "system"


def keep_freed_memory(keep: bool = True) -> bool:
    """glibc: serve every allocation from the heap and keep what is freed there for reuse.

    By default glibc maps each block over its mmap threshold (at most 32 MiB) afresh and unmaps it
    when freed. A CPU update's activations and logits are such blocks, hundreds of MB of them, so
    every update would fault its memory in anew, in the kernel. Kept, the freed blocks of one update
    serve the next (bench/bench.py times it: the glibc-* rows against plain-*; docs/speed.md), at the
    cost of a resident set that holds the largest update's blocks.
    `keep=False` goes back to glibc's defaults, with the mmap threshold where glibc's own
    adjustment would take it for blocks this large. True where glibc took the settings; False
    where the process runs on another malloc (mimalloc), which these settings would not reach.
    Only the main arena keeps blocks of 64 MiB and more: glibc maps them afresh in its other
    arenas (other threads', and the main thread's after an allocation failed), whatever mallopt says."""
    libc = _glibc()
    if libc is None or allocator() != "glibc":
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
    if libc is not None and allocator() == "glibc":
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
