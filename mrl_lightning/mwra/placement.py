"""Placement: which ranks (worker processes) run which policy (docs/mwra.md).

Two modes:

- ``colocated``: every policy on every rank; each rank runs the policies' phases in
  turn. With one rank this is a plain single-process run; with k ranks every policy is
  data-parallel over all k.
- ``disjoint``: the world is split into one group of ranks per policy, sized by
  ``policy_ranks`` (e.g. ``{gpt2: 1, llama: 1}`` or ``{qwen: 4, llama: 4}``); groups run
  their policy's rollouts and updates at the same time.

``auto`` picks ``disjoint`` when there is more than one rank and the ranks split evenly
over the policies, and ``colocated`` otherwise. ``cost`` starts from ``auto``'s and is then
replaced by the placement with the shortest predicted step (:mod:`mrl_lightning.mwra.cost`).

Groups are contiguous blocks of global ranks in the order of ``model.policies``, so on a
node of 8 GPUs with ``{qwen: 4, llama: 4}`` qwen owns GPUs 0-3 and llama 4-7.
Everything here is pure Python: a placement is built and validated from the config
before any process is launched or any model is built.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from mrl_lightning.errors import ConfigError

PLACEMENTS = ("auto", "colocated", "disjoint", "cost")


@dataclass(frozen=True)
class Placement:
    """The ranks each policy owns.

    Attributes:
        mode: ``"colocated"`` or ``"disjoint"`` (never ``"auto"``: resolved).
        groups: Policy name -> its global ranks, ascending, in ``model.policies`` order.
        world_size: Number of ranks (processes) in the run.
    """

    mode: str
    groups: dict[str, tuple[int, ...]]
    world_size: int

    def policies_on(self, rank: int) -> list[str]:
        """Policies rank ``rank`` runs, in ``model.policies`` order."""
        return [name for name, ranks in self.groups.items() if rank in ranks]

    def leader(self, policy: str) -> int:
        """The lowest rank of ``policy``'s group (it materializes and reports for the group)."""
        return self.groups[policy][0]


def _nearest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def build_placement(
    mode: str,
    policy_ranks: dict[str, int] | None,
    policy_names: list[str],
    world_size: int,
) -> Placement:
    """Resolve and validate a placement.

    Args:
        mode: ``trainer.placement``: "auto", "colocated", "disjoint" or "cost" (resolved here as "auto"; the
            cost model replaces it later, :func:`~mrl_lightning.mwra.cost.place_by_cost`).
        policy_ranks: ``trainer.policy_ranks``: ranks per policy (disjoint only); None
            splits the world evenly.
        policy_names: ``model.policies`` names, in order.
        world_size: ``trainer.devices`` x ``trainer.num_nodes``.

    Returns:
        The :class:`Placement`.

    Raises:
        ConfigError: an unknown mode, ``policy_ranks`` naming an unknown policy, a policy
            with no ranks, ranks that do not add up to the world size, or ``policy_ranks``
            with ``colocated`` or ``cost`` (every problem at once, each naming the field and the fix).
    """
    errors: list[str] = []
    if mode not in PLACEMENTS:
        raise ConfigError(f"trainer.placement={mode!r}{_nearest(str(mode), list(PLACEMENTS))}; valid: {list(PLACEMENTS)}.")
    if mode == "cost":
        if policy_ranks is not None:
            raise ConfigError(f"trainer.policy_ranks={policy_ranks} with trainer.placement: cost, which chooses the "
                              "ranks itself; remove trainer.policy_ranks, or keep it with trainer.placement: disjoint.")
        mode = "auto"
    if mode == "auto":
        if policy_ranks is not None:
            mode = "disjoint"
        else:
            mode = "disjoint" if world_size > 1 and world_size % len(policy_names) == 0 else "colocated"
    if mode == "colocated":
        if policy_ranks is not None:
            errors.append(f"trainer.policy_ranks={policy_ranks} only applies to trainer.placement: disjoint; "
                          "remove it (colocated runs every policy on every rank) or set placement: disjoint.")
        if errors:
            raise ConfigError("Invalid placement:\n  - " + "\n  - ".join(errors))
        ranks = tuple(range(world_size))
        return Placement("colocated", {name: ranks for name in policy_names}, world_size)

    if policy_ranks is None:
        if world_size < len(policy_names):
            raise ConfigError(
                f"trainer.placement: disjoint gives each of the {len(policy_names)} policies {policy_names} "
                f"ranks of its own, but the run has {world_size} rank(s); set --trainer.devices "
                f"{len(policy_names)} (one per policy) or --trainer.placement colocated.")
        if world_size % len(policy_names):
            example = {n: 1 for n in policy_names}
            example[policy_names[0]] += world_size - len(policy_names)
            raise ConfigError(
                f"trainer.placement: disjoint splits {world_size} rank(s) over {len(policy_names)} policies "
                f"{policy_names}, which does not divide evenly; give trainer.policy_ranks summing to "
                f"{world_size} (e.g. {example}) or set --trainer.devices to a multiple of {len(policy_names)}.")
        policy_ranks = {name: world_size // len(policy_names) for name in policy_names}
    for name in policy_ranks:
        if name not in policy_names:
            errors.append(f"trainer.policy_ranks names policy {name!r}{_nearest(name, policy_names)}, which is not "
                          f"in model.policies {policy_names}.")
    for name in policy_names:
        count = policy_ranks.get(name, 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            errors.append(f"trainer.policy_ranks.{name}={policy_ranks.get(name)!r}: every policy needs at least "
                          f"1 rank in a disjoint placement; give it one (e.g. {name}: 1).")
    if not errors:
        asked = sum(policy_ranks[n] for n in policy_names)
        if asked > world_size:
            errors.append(f"trainer.policy_ranks asks for {asked} ranks ({policy_ranks}) but the run has "
                          f"{world_size} (trainer.devices x trainer.num_nodes); raise --trainer.devices to {asked} "
                          "or give fewer ranks per policy.")
        elif asked < world_size:
            errors.append(f"trainer.policy_ranks gives out {asked} ranks ({policy_ranks}) but the run has "
                          f"{world_size}; {world_size - asked} would idle. Lower --trainer.devices to {asked} or "
                          "give the extra ranks to a policy.")
    if errors:
        raise ConfigError("Invalid placement:\n  - " + "\n  - ".join(errors))
    groups, start = {}, 0
    for name in policy_names:
        groups[name] = tuple(range(start, start + policy_ranks[name]))
        start += policy_ranks[name]
    return Placement("disjoint", groups, world_size)


def shard_indices(num_items: int, index: int, size: int) -> list[int]:
    """The batch positions of shard ``index`` when ``num_items`` whole prompts split over ``size`` ranks.

    Strided: shard r holds positions ``r, r + size, r + 2*size, ...``, so every rank sees the
    batch's mixture of task parts (the data module lays a batch out part by part) and the
    shards differ in size by at most one. Their union is the batch.

    Raises:
        ValueError: ``index`` outside ``[0, size)``.
    """
    if not 0 <= index < size:
        raise ValueError(f"shard index {index} outside [0, {size}).")
    return list(range(index, num_items, size))


@dataclass(frozen=True)
class DeviceSettings:
    """``trainer.devices`` and ``trainer.placement`` as a run will use them (:func:`resolve_devices`).

    Attributes:
        accelerator: ``trainer.accelerator`` as given (Fabric resolves "auto" the same way).
        devices: Processes (devices) per node to start.
        placement: ``trainer.placement`` to build (``"colocated"`` when lowered to one device from "auto").
        strategy: ``trainer.strategy`` as given.
        note: One line for the plan when ``devices`` was lowered (``""`` otherwise), e.g. "trainer.devices:
            asked 2, found 1 cuda device, ran colocated on it".
    """

    accelerator: str
    devices: int
    placement: str
    strategy: str
    note: str = ""


def resolve_devices(accelerator: str, devices: int, placement: str, strategy: str, present: dict[str, int],
                    num_nodes: int = 1, policy_ranks: dict | None = None) -> DeviceSettings | str:
    """What the run uses when ``trainer.devices`` asks for more GPUs than this node has: pure, no torch.

    A config written for two CPU workers or for a node of 8 GPUs runs on a machine with one GPU: the
    devices are lowered to those present and an ``auto`` placement becomes ``colocated`` on one device
    (every policy on it, in turn). A placement that gives each policy devices of its own (``disjoint``,
    or ``trainer.policy_ranks``) is the config's decision, so it is refused with the flag that lifts it.
    Nothing changes on the CPU (devices are processes there; the plan checks them against the cores),
    nor when the devices fit. Decision table: docs/mwra.md, "One GPU".

    Args:
        accelerator: ``trainer.accelerator``: "auto", "cpu", "cuda", "gpu", "mps", ...
        devices: ``trainer.devices`` (an integer >= 1, already checked).
        placement: ``trainer.placement``: "auto", "colocated" or "disjoint".
        strategy: ``trainer.strategy``: "auto" or "ddp" (kept as given).
        present: Devices this node has, by kind: ``{"cuda": n, "mps": 0 or 1}`` (:func:`devices_present`).
        num_nodes: ``trainer.num_nodes``: with several nodes nothing is lowered (every node must agree).
        policy_ranks: ``trainer.policy_ranks`` (a disjoint placement's sizes), or None.

    Returns:
        The :class:`DeviceSettings`, or one line naming the field and the flag to add when the run cannot
        be fitted to this node.
    """
    name = str(accelerator).lower()
    cuda, mps = int(present.get("cuda", 0)), int(present.get("mps", 0))
    if name == "auto":  # Fabric's order: a CUDA GPU, else Apple's MPS, else the CPU
        kind = "cuda" if cuda else "mps" if mps else "cpu"
    elif name in ("cuda", "gpu"):
        kind = "mps" if name == "gpu" and not cuda and mps else "cuda"
    else:
        kind = name
    found = {"cuda": cuda, "mps": mps}.get(kind)
    same = DeviceSettings(accelerator, devices, placement, strategy)
    if found is None or devices <= found:  # the CPU (or another accelerator), or the devices fit
        return same
    if found == 0:
        return (f"trainer.accelerator={accelerator!r} but no {kind} device is visible here; add "
                "--trainer.accelerator cpu.")
    where = f"trainer.devices={devices} but this node has {found} {kind} device(s)"
    if num_nodes > 1:
        return f"{where} (trainer.num_nodes={num_nodes}); add --trainer.devices {found} on every node."
    if placement == "disjoint" or policy_ranks is not None:
        own = f"trainer.policy_ranks={policy_ranks}" if policy_ranks is not None else "trainer.placement=disjoint"
        flags = "--trainer.placement colocated" + (" --trainer.policy_ranks null" if policy_ranks is not None else "")
        return (f"{where}, and {own} gives each policy devices of its own; add --trainer.devices {found} {flags} "
                f"to run every policy on the {found} device(s) in turn.")
    placement_now = "colocated" if found == 1 and placement in ("auto", "cost") else placement
    ran = "ran colocated" if found == 1 or placement_now == "colocated" else f"placement {placement_now}"
    note = f"trainer.devices: asked {devices}, found {found} {kind} device(s), {ran}."
    return DeviceSettings(accelerator, found, placement_now, strategy, note)


def devices_present() -> dict[str, int]:
    """The accelerators this node has, by kind, for :func:`resolve_devices` (reads torch; CUDA's count honours
    ``CUDA_VISIBLE_DEVICES``)."""
    import torch

    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return {"cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0, "mps": int(bool(mps))}
