"""Code run inside spawned gloo worker processes by test_invariant_data_parallel.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.builders import build_policy as build_model
from mrl_lightning.mwra import Workers, build_placement, shard_indices
from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import loss_counts, policy_update

FABRIC = SimpleNamespace(
    backward=lambda loss: loss.backward(),
    clip_gradients=lambda module, optimizer, max_norm: torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm),
)


def build_policy(folder, loss_type: str, g: int, length: int, **options) -> PolicyModule:
    policy = PolicyModule(name="p", model=str(folder), temperature=0.7, num_generations=g, max_completion_length=length,
                          loss_type=loss_type, mask_truncated_completions=True, **options)
    build_model(policy)
    return policy


def shard_rollout(rollout, rows: list[int]):
    """The rows of one rank's prompts (tensors and per-row lists taken alike)."""
    return replace(rollout, prompt_ids=rollout.prompt_ids[rows], prompt_mask=rollout.prompt_mask[rows],
                   completion_ids=rollout.completion_ids[rows], completion_mask=rollout.completion_mask[rows],
                   old_logprobs=rollout.old_logprobs[rows], finish_reasons=[rollout.finish_reasons[r] for r in rows],
                   completion_texts=[rollout.completion_texts[r] for r in rows])


def update(policy, rollout, advantages, workers=None, name="p"):
    """One SGD step of ``policy_update``; returns the parameters after it."""
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    batch = TrainBatch(scored=SimpleNamespace(rollouts=rollout), advantages=advantages,
                       counts=loss_counts(policy, rollout))
    sync = gather = None
    if workers is not None:
        batch.group_counts = workers.group_sum(name, batch.counts)
        sync, gather = partial(workers.reduce_gradients, name), partial(workers.group_gather, name)
    policy_update(policy, batch, policy.model, FABRIC, optimizer, reduce_gradients=sync, gather=gather)
    return [p.detach().clone() for p in policy.model.parameters()]


def run(rank: int, world: int, folder: str, work: str, cases: dict[str, dict]) -> None:
    work = Path(work)
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data = torch.load(work / "rollout.pt", weights_only=False)
    rollout, advantages, g = data["rollout"], data["advantages"], data["g"]
    result = {}
    # SEE across ranks: two policies on both ranks; each rank publishes different records.
    both = Workers(build_placement("colocated", None, ["a", "b"], world), rank, timeout_s=60)
    result["exchange"] = both.exchange({"a": [[f"a/r{rank}/{i}"] for i in range(2)], "b": [[f"b/r{rank}"]]})
    # One policy data-parallel over every rank.
    workers = Workers(build_placement("colocated", None, ["p"], world), rank, timeout_s=60)
    prompts = shard_indices(advantages.shape[0], rank, world)
    result["prompts"] = prompts
    rows = [b * g + k for b in prompts for k in range(g)]
    for case, options in cases.items():
        policy = build_policy(folder, g=g, length=rollout.completion_ids.shape[1], **options)
        result[case] = update(policy, shard_rollout(rollout, rows), advantages[prompts].clone(), workers)
    torch.save(result, work / f"rank{rank}.pt")
    dist.destroy_process_group()
