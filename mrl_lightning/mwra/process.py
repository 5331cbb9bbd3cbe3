"""This worker process's threads and memory, as the resource plan reads them (docs/mwra.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource


def process_rss_bytes() -> float:
    """Resident memory of this process now, bytes (Linux ``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_cores() -> int:
    """CPU cores this process may run on (its affinity where the OS reports one, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive int, or None when unset or not one (threads per worker)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def peak_memory_gib(device) -> float:
    """Peak memory of this worker so far, GiB: the CUDA allocator's peak on a GPU, else the process's peak RSS.

    On Linux the peak RSS is ``VmHWM`` of ``/proc/self/status``, this process's own. ``getrusage``'s
    ``ru_maxrss`` is not: a process started with ``vfork`` + ``exec`` (Python's ``subprocess``)
    inherits its parent's peak into it (measured: a worker started by a test process that had
    held 5.4 GiB reported 5.4 GiB from its first step). ``ru_maxrss`` elsewhere.
    """
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


TRIM_MIN_FREE_BYTES = 64 * 2**20
""":func:`release_free_memory` trims only when the heap holds at least this much free memory."""

_LIBC = None  # the C library, once looked up (False: none to call)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
        if _LIBC and hasattr(_LIBC, "mallinfo2"):
            _LIBC.mallinfo2.restype = _MallInfo2
    return _LIBC


def release_free_memory(min_free_bytes: int = TRIM_MIN_FREE_BYTES) -> bool:
    """Hand the C allocator's free memory back to the operating system (glibc ``malloc_trim(0)``).

    Sampling allocates many ``[N, V]`` float32 blocks (every step's logits, its tempered and
    perturbed scores): at a large vocabulary each is a few to tens of MB, below glibc's
    adaptive mmap threshold, so it comes from the heap, and once freed stays in the process
    as free heap memory that later, differently sized, allocations do not reuse. Measured on
    Gemma-3-270M (V = 262,144, 16 x 32 tokens): 0.7 GiB kept after each ``generate``, which
    the resource plan would have to count on top of the update; trimming returns it, and
    the plan's per-phase terms hold (docs/mwra.md, "The memory model"). The loop calls this
    at the end of its build, rollout, update and evaluation phases. A heap with less than
    ``min_free_bytes`` free (glibc's ``mallinfo2``, 2.33+) is left alone: trimming small
    heaps costs more in page faults than it returns (tiny models).

    Args:
        min_free_bytes: Trim only when the heap has at least this many free bytes.

    Returns:
        True when memory was returned; False otherwise (little free, or no glibc: nothing done).
    """
    libc = _libc()
    if not libc or not hasattr(libc, "malloc_trim"):
        return False
    if hasattr(libc, "mallinfo2") and libc.mallinfo2().fordblks < min_free_bytes:
        return False
    return bool(libc.malloc_trim(0))
