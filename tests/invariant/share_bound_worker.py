"""Worker of test_invariant_share_bound: one policy on 2 gloo ranks (plain data parallel or FSDP2), many steps
with an auxiliary term whose share is bounded while GRPO's gradient weakens, vanishes and returns."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dp_worker import FABRIC, build_policy, shard_rollout
from fsdp_worker import SumTerm
from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.mwra import Workers, build_placement, shard_indices
from mrl_lightning.mwra.sharding import full_state, shard_model
from mrl_lightning.objectives.aux_share import term_names
from mrl_lightning.update.policy_update import loss_counts, policy_update

BOUND = 0.3
# GRPO's signal per step: full, weaker, nearly gone, gone (twice), back, stronger than at first
SCALES = [1.0, 0.25, 0.02, 0.0, 0.0, 1.0, 4.0]


class BoundedTerm(SumTerm):
    """SumTerm, ten times as strong (so the bound binds whenever GRPO has a signal), bounded at BOUND."""

    max_grad_share = BOUND

    def __call__(self, policy, model, totals):
        loss, metrics = super().__call__(policy, model, totals)
        return 10.0 * loss, metrics


def steps(policy, rollout, advantages, aux_rollout, workers=None, name="p") -> list[dict[str, float]]:
    """len(SCALES) SGD steps of ``policy_update`` with the term; per step its metrics (plain floats)."""
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.05)
    out = []
    for scale in SCALES:
        batch = TrainBatch(scored=SimpleNamespace(rollouts=rollout), advantages=advantages * scale,
                           counts=loss_counts(policy, rollout))
        if aux_rollout is not None:
            batch.aux_losses.append(BoundedTerm(aux_rollout))
        reduce = None
        if workers is not None:
            batch.group_counts = workers.group_sum(name, batch.counts)
            batch.group_terms = workers.group_terms(name, term_names(batch.aux_losses))
            reduce = None if policy.fsdp else partial(workers.reduce_gradients, name)
        metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer, reduce_gradients=reduce)
        out.append({k: float(v) for k, v in metrics.items() if k.startswith("probe/")})
    return out


def run(rank: int, world: int, folder: str, work: str, fsdp: bool) -> None:
    work = Path(work)
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data = torch.load(work / "rollout.pt", weights_only=False)
    rollout, advantages, g = data["rollout"], data["advantages"], data["g"]
    workers = Workers(build_placement("colocated", None, ["p"], world), rank, timeout_s=60)
    policy = build_policy(folder, "dapo", g, rollout.completion_ids.shape[1])
    if fsdp:
        policy.fsdp = True
        shard_model(policy.model, workers.process_group("p"), "cpu")
    prompts = shard_indices(advantages.shape[0], rank, world)
    rows = [b * g + k for b in prompts for k in range(g)]
    aux = shard_rollout(rollout, rows[:g]) if rank == 1 else None  # the term on rank 1 only
    metrics = steps(policy, shard_rollout(rollout, rows), advantages[prompts].clone(), aux, workers)
    weights = full_state({n: p.detach() for n, p in policy.model.named_parameters()})
    torch.save({"metrics": metrics, "weights": weights}, work / f"rank{rank}.pt")
    dist.destroy_process_group()
