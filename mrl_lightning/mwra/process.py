"""This worker process's threads and memory, as the resource plan reads them (docs/mwra.md)."""

from __future__ import annotations

import os
import resource


def process_rss_bytes() -> float:
    """Resident memory of this process now, bytes (Linux ``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` as a positive int, or None when unset or not one (threads per worker)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def peak_memory_gib(device) -> float:
    """Peak memory of this worker so far: the CUDA allocator's peak on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
