"""Worker of test_invariant_fsdp: one policy sharded (FSDP2) over 2 gloo ranks, one step, the weights after it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from dp_worker import FABRIC, build_policy, shard_rollout
from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.mwra import Workers, build_placement, shard_indices
from mrl_lightning.mwra.sharding import full_state, full_weights, load_full_state, shard_model
from mrl_lightning.objectives.aux_share import term_names
from mrl_lightning.update.policy_update import loss_counts, policy_update


class SumTerm:
    """An auxiliary term on this rank's rows only: lambda * sum of the completions' log-probs / the group's sequences."""

    name, max_grad_share = "aux", 0.4

    def __init__(self, rollout):
        self.r = rollout

    def __call__(self, policy, model, totals):
        logp, _ = policy.completion_logprobs(self.r.prompt_ids, self.r.prompt_mask, self.r.completion_ids,
                                             self.r.completion_mask, model=model)
        return -0.5 * (logp * self.r.completion_mask).sum() / totals["sequences"], {}


def update(policy, rollout, advantages, aux_rollout, workers=None, name="p"):
    """One momentum-SGD step of ``policy_update`` with an auxiliary term; returns the full parameters after it.

    SGD, not AdamW: its step is linear in the gradient, so the weights compare as the gradients do. AdamW
    divides by the gradient's own size and turns float noise on a gradient that is zero in exact
    arithmetic (GPT-2's key biases: softmax ignores a shift shared by every key) into a full +-lr step.
    """
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.5, momentum=0.9)
    batch = TrainBatch(scored=SimpleNamespace(rollouts=rollout), advantages=advantages,
                       counts=loss_counts(policy, rollout))
    if aux_rollout is not None:
        batch.aux_losses.append(SumTerm(aux_rollout))
    if workers is not None:
        batch.group_counts = workers.group_sum(name, batch.counts)
        batch.group_terms = workers.group_terms(name, term_names(batch.aux_losses))
    metrics = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    return full_state({n: p.detach() for n, p in policy.model.named_parameters()}), metrics, optimizer


def run(rank: int, world: int, folder: str, work: str) -> None:
    work = Path(work)
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data = torch.load(work / "rollout.pt", weights_only=False)
    rollout, advantages, g = data["rollout"], data["advantages"], data["g"]
    workers = Workers(build_placement("colocated", None, ["p"], world), rank, timeout_s=60)
    policy = build_policy(folder, "dapo", g, rollout.completion_ids.shape[1])
    policy.fsdp = True
    shard_model(policy.model, workers.process_group("p"), "cpu")
    prompts = shard_indices(advantages.shape[0], rank, world)
    rows = [b * g + k for b in prompts for k in range(g)]
    mine = shard_rollout(rollout, rows)
    aux = shard_rollout(rollout, rows[:g]) if rank == 1 else None  # the term on rank 1 only
    weights, metrics, optimizer = update(policy, mine, advantages[prompts].clone(), aux, workers)
    from torch.distributed.tensor import DTensor

    from mrl_lightning.rollout.hf_generate import HFGenerateEngine

    with full_weights(policy.model):  # generation on the full weights, a different number of rows per rank
        with full_weights(policy.model):  # nested (an evaluation around its rollouts): a no-op, no collective
            pass
        if rank == 0:  # an evaluation part with no prompt for rank 1: only rank 0 generates
            HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(["7 - 5?"]),
                                        num_generations=2, max_completion_length=4, prompt_seeds=[1])
        HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(["7 - 5?"] * (rank + 1)),
                                    num_generations=2, max_completion_length=4, prompt_seeds=[1] * (rank + 1))
    resident = {"policy_wte": type(policy.model.transformer.wte.weight.data).__name__}
    reference = build_policy(folder, "dapo", g, rollout.completion_ids.shape[1]).model
    shard_model(reference, workers.process_group("p"), "cpu", reshard_root=True)
    with torch.no_grad():  # a forward-only model: its root (embeddings, head) back to 1/k after the forward
        policy.completion_logprobs(mine.prompt_ids, mine.prompt_mask, mine.completion_ids, mine.completion_mask,
                                   model=reference)
    resident["reference_wte_sharded"] = isinstance(reference.transformer.wte.weight, DTensor)
    full = {"model": full_state(policy.model.state_dict()), "optimizer": full_state(optimizer.state_dict())}
    # the full state loads back into the sharded model: the same full weights again
    load_full_state(policy.model, optimizer, full["model"], full["optimizer"])
    again = full_state({n: p.detach() for n, p in policy.model.named_parameters()})
    torch.save({"weights": weights, "metrics": {k: float(v) for k, v in metrics.items()}, "full": full,
                "again": again, "resident": resident}, work / f"rank{rank}.pt")
    dist.destroy_process_group()
