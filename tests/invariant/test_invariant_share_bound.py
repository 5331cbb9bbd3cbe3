"""The bound on an auxiliary term's share holds on every step on a data-parallel group and under FSDP,
equal to one rank's on the whole batch (docs/probes.md, "Bound"; docs/mwra.md).

Two gloo processes take strided halves of the batch; only rank 1 holds the term's rows (rank 0 reduces
the group's term with a part of 0, or, sharded, runs an empty share of it). GRPO's advantages are
scaled step by step (weaker, gone, back), and the weights move between steps. At every step each
rank must log the share one rank on the whole batch logs, at most the bound, and 0 where GRPO has
no signal (the strict bound); the weights at the end must match.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import dp_worker
import share_bound_worker as worker
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "Calculate 12 + 34.", "What is 9 - 7?"]
G, L = 3, 6
ADVANTAGES = torch.tensor([[1.0, -0.5, -0.25], [0.3, -1.2, 0.9], [0.0, 0.7, -0.7], [-1.0, 0.2, 0.4]])
SHARE = "probe/aux/p/grad_share"


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_two_ranks_bound_the_share_on_every_step_as_one_rank_does(invariant_lm_dir, tmp_path, fsdp):
    if fsdp:
        pytest.importorskip("torch.distributed.fsdp")
    policy = dp_worker.build_policy(invariant_lm_dir, "dapo", G, L)
    torch.manual_seed(3)
    rollout = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                          num_generations=G, max_completion_length=L, temperature=0.7)
    torch.save({"rollout": rollout, "advantages": ADVANTAGES, "g": G}, tmp_path / "rollout.pt")
    mp.start_processes(worker.run, args=(2, str(invariant_lm_dir), str(tmp_path), fsdp), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    whole = dp_worker.build_policy(invariant_lm_dir, "dapo", G, L)
    aux_rows = [1 * G + k for k in range(G)]  # rank 1's first prompt is batch position 1 (strided shards)
    one = worker.steps(whole, rollout, ADVANTAGES.clone(), dp_worker.shard_rollout(rollout, aux_rows))
    for k, (scale, ref) in enumerate(zip(worker.SCALES, one)):
        assert ref[SHARE] <= worker.BOUND + 1e-6, f"step {k}: one rank's share {ref[SHARE]}"
        if scale == 0.0:
            assert ref[SHARE] == 0.0 and ref["probe/aux/p/grad_scale"] == 0.0, f"step {k}: no GRPO signal"
        elif scale >= 0.25:
            assert ref[SHARE] == pytest.approx(worker.BOUND, abs=1e-5), f"step {k}: the bound binds"
        for r, rank in enumerate(ranks):
            got = rank["metrics"][k]
            assert got[SHARE] <= worker.BOUND + 1e-6, f"rank {r} step {k}: {got[SHARE]}"
            for tag in (SHARE, "probe/aux/p/grad_share_raw", "probe/aux/p/grad_scale"):
                assert got[tag] == pytest.approx(ref[tag], rel=1e-4, abs=1e-6), f"rank {r} step {k} {tag}"
    final = dict(whole.model.named_parameters())
    for rank in ranks:
        for name, value in rank["weights"].items():
            torch.testing.assert_close(value, final[name].detach(), rtol=0, atol=1e-5, msg=name)
