"""Random streams that do not depend on placement (docs/mwra.md, "Reproducibility").

Sampling (rollouts and evaluation) runs inside :func:`sampling_rng`: every generator of
the process (the CPU one and each visible CUDA device's) is saved, seeded from a key,
and restored afterwards. A policy's rollout at step k is keyed by (run seed, policy
name, "rollout", k, shard), so it depends on those and the policy's weights only: which
process runs it, and what ran before it in that process, do not matter. Nothing outside
the context sees a generator change, so evaluation perturbs no training stream.

``torch.manual_seed`` seeds *every* CUDA device, while ``torch.random.fork_rng(devices=[])``
restores only the CPU generator: forking the CPU alone and seeding would silently reset
each GPU's sampling stream (two runs with different seeds would then sample alike on a
GPU). :func:`sampling_rng` forks every visible device for that reason. On a CPU-only or
CUDA host it seeds exactly the generators it forks, the CPU one and each visible CUDA
device's, not through ``torch.manual_seed``, which would also queue a seed for every absent
device type, formatting a stack trace each time (~3 ms per rollout step of the default on
the reference CPU). On other accelerators (MPS, XPU) it calls ``torch.manual_seed``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from mrl_lightning.data.stream import seed_for


def stream_seed(run_seed: int, policy: str, kind: str, step: int, *extra: Any) -> int:
    """The 32-bit seed of one sampling call (stable across processes and machines)."""
    return seed_for(run_seed, policy, kind, step, *extra)


@contextlib.contextmanager
def sampling_rng(seed: int) -> Iterator[None]:
    """Run the body with every torch generator seeded by ``seed``; restore them all after.

    Covers the CPU generator and the generator of every visible CUDA device.
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type == "cuda":
            torch.default_generator.manual_seed(seed)
            if devices:  # fork_rng has initialized CUDA: this seeds every visible device at once
                torch.cuda.manual_seed_all(seed)
        else:  # MPS, XPU, ...: every generator torch.manual_seed seeds, as for any other run
            torch.manual_seed(seed)
        yield


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch CPU and CUDA generator states (weights-only safe).

    Returns:
        ``{"python", "numpy", "torch", "cuda"}``; ``cuda`` is a list with one uint8 tensor
        per visible device (empty without CUDA).
    """
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    cuda = [s.cpu() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: dict[str, Any]) -> list[str]:
    """Inverse of :func:`rng_state`.

    CUDA states are restored when this process sees the same number of devices;
    otherwise they are skipped.

    Returns:
        Notes on what could not be restored (empty when everything was).
    """
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda and len(cuda) == visible:
        torch.cuda.set_rng_state_all(cuda)
        return []
    if cuda:
        return [f"the checkpoint holds {len(cuda)} CUDA generator state(s) but {visible} device(s) are visible; "
                "CUDA generators were not restored (sampling streams are keyed by step and unaffected)."]
    return []
