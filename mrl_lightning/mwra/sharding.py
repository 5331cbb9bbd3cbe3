"""FSDP inside a policy's group: parameters, gradients and optimizer state sharded over its ranks (docs/mwra.md).

A policy with ``fsdp: true`` on a group of k ranks is sharded with torch's FSDP2
(``fully_shard``) over the group's own device mesh (``DeviceMesh.from_group`` of the
process group MWRA made for it): each transformer block (the model's
``_no_split_modules``) is one unit and the root holds the rest, so a policy on another
group runs plain data parallelism or nothing, untouched. What changes for the loop:

- the update's forward passes all-gather each unit's weights and its backward passes
  reduce-scatter the gradients, *summed* over the group (the losses are already divided by
  the group's totals, as for plain data parallelism, so the k shards hold the gradient of
  one rank on the whole batch); every rank runs the same forward passes, so an auxiliary
  term another rank has runs here on an empty share (:func:`mrl_lightning.update.policy_update.policy_update`);
- rollouts and evaluation run on the full weights (:func:`full_weights`: every unit
  unsharded for the call, resharded after), since each rank samples its own prompts and
  stops when they are done, which per-step collectives could not follow;
- checkpoints hold full tensors (:func:`full_state`, gathered in the group) and a sharded
  run loads them by slicing its shard (:func:`load_full_state`), so a checkpoint resumes
  sharded or not, on any number of ranks.

Tested on CPU with gloo (torch 2.13): a sharded 2-rank step equals the unsharded one. gloo
has no pre-multiplied sum, so reductions are plain sums (``set_force_sum_reduction_for_comms``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def is_sharded(model) -> bool:
    """True when ``model`` (or the module a Fabric wrapper holds) was sharded by :func:`shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "module", model), FSDPModule)


def shard_model(model: torch.nn.Module, group, device_type: str, reshard_root: bool = False) -> None:
    """Shard ``model`` in place over ``group`` (each transformer block a unit, then the root).

    Args:
        model: A Hugging Face causal LM with its full weights (the same on every rank of the group).
        group: The policy's ``torch.distributed`` process group.
        device_type: ``"cpu"`` or ``"cuda"``.
        reshard_root: Reshard the root unit (embeddings, head) after each forward. FSDP2 keeps it
            whole until the backward by default; a model that only runs forwards (the frozen
            reference) has no backward, so it needs True to stay at 1/k.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh, **({"reshard_after_forward": True} if reshard_root else {}))  # else FSDP2's root default
    model._mrl_reshard_root = reshard_root
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: losses are already divided by the group's totals
            module.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def full_weights(model) -> Iterator[None]:
    """Every FSDP unit of ``model`` unsharded for the block (rollouts, evaluation); resharded after.

    A no-op for a model that is not sharded.
    """
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(model):
        yield
        return
    root = getattr(model, "module", model)
    if getattr(root, "_mrl_full_weights", False):  # nested (an evaluation around its rollouts): already whole
        yield
        return
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    root.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    root._mrl_full_weights = True
    try:
        yield
    finally:
        root._mrl_full_weights = False
        for unit in units:
            unit.reshard()
            # back to what shard_model set: blocks reshard after forward, the root as it was asked
            unit.set_reshard_after_forward(unit is not root or getattr(root, "_mrl_reshard_root", False),
                                           recurse=False)


def full_state(state: Any) -> Any:
    """``state`` with every sharded tensor (DTensor) gathered to its full value, on CPU, detached.

    Other tensors are returned as they are. A collective over each tensor's mesh: every rank of the group calls it, in the same order.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.detach().full_tensor().cpu()
    if isinstance(state, dict):
        return {k: full_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_state(v) for v in state)
    return state


def load_full_state(model, optimizer, weights: dict[str, torch.Tensor], optimizer_state: dict) -> None:
    """Load full tensors (a checkpoint) into a sharded model and its optimizer: each rank takes its shard.

    Args:
        model: The sharded model (its parameters are DTensors).
        optimizer: Its optimizer (state keyed by parameter index, as ``state_dict`` gives it).
        weights: Full ``state_dict`` of the model.
        optimizer_state: Full optimizer ``state_dict``.

    Raises:
        RuntimeError: a weight is missing or unexpected, or its shape differs.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = model.state_dict()
    if set(own) != set(weights):
        missing, extra = sorted(set(own) - set(weights))[:3], sorted(set(weights) - set(own))[:3]
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for key, value in own.items():
            full = weights[key]
            if tuple(full.shape) != tuple(value.shape):
                raise RuntimeError(f"size mismatch for {key}: {tuple(full.shape)} vs {tuple(value.shape)}")
            if isinstance(value, DTensor):
                shard = distribute_tensor(full.to(value.device, value.dtype), value.device_mesh, value.placements,
                                          src_data_rank=None)
                value.to_local().copy_(shard.to_local())
            else:
                value.copy_(full)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {"param_groups": optimizer_state["param_groups"], "state": {}}
    for index, entry in optimizer_state["state"].items():
        param = params[int(index)]
        state["state"][index] = {
            k: (distribute_tensor(v.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
                if isinstance(param, DTensor) and torch.is_tensor(v) and tuple(v.shape) == tuple(param.shape) else v)
            for k, v in entry.items()}
    foreach = [group.get("foreach") for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, value in zip(optimizer.param_groups, foreach):  # the saved groups carry the writer's choice
        group["foreach"] = value


def sharding_errors(placement, policies: dict, batch_size: int) -> list[str]:
    """Problems of ``fsdp: true`` policies in this placement, before any model is built.

    Refused: a 1-rank group (nothing to shard over) and ``micro_batch_size`` with a
    batch that does not split evenly over the group (every rank must run as many forward
    passes as the others).

    Returns:
        Messages naming the field, the value and the fix.
    """
    errors = []
    for name, policy in policies.items():
        if not getattr(policy, "fsdp", False):
            continue
        ranks = placement.groups[name]
        where = f"policy {name!r}: fsdp=true"
        if len(ranks) < 2:
            errors.append(f"{where} needs a group of 2 or more ranks to shard over; it has {len(ranks)}. Give it more "
                          f"with --trainer.devices and trainer.policy_ranks (e.g. {{{name}: 2, ...}}), or set fsdp: false.")
        elif policy.micro_batch_size is not None and batch_size % len(ranks):
            errors.append(f"{where} with micro_batch_size={policy.micro_batch_size} needs data.batch_size "
                          f"({batch_size}) divisible by its {len(ranks)} ranks (each rank runs as many forward "
                          "passes as the others); change batch_size or set micro_batch_size: null.")
    return errors
