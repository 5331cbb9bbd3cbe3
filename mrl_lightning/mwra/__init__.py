"""MWRA: placement of policies on workers, the resource plan, and the collectives between workers.

See docs/mwra.md. ``placement`` (which ranks run which policy), ``plan`` (threads and
memory estimate, validated before any model is built), ``memory`` (the estimate's terms),
``process`` (this process's threads, peak memory and the allocator's free memory),
``strategy`` (the Fabric strategy of multi-process runs), ``launcher`` (starting and
watching one node's workers), ``workers`` (what this rank runs; collectives), ``rng``
(placement-independent sampling streams).
"""

from mrl_lightning.mwra.placement import (PLACEMENTS, DeviceSettings, Placement, build_placement, devices_present,
                                          resolve_devices, shard_indices)
from mrl_lightning.mwra.plan import PolicyPlacement, build_plan, format_plan, model_shape, validate_resources
from mrl_lightning.mwra.rng import rng_state, sampling_rng, set_rng_state, stream_seed
from mrl_lightning.mwra.workers import CollectiveError, WorkerError, Workers

__all__ = [
    "CollectiveError", "DeviceSettings", "PLACEMENTS", "Placement", "PolicyPlacement", "WorkerError", "Workers",
    "build_placement", "build_plan", "devices_present", "format_plan", "model_shape", "resolve_devices", "rng_state",
    "sampling_rng", "set_rng_state", "shard_indices", "stream_seed", "validate_resources",
]
