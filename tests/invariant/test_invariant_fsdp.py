"""FSDP inside a policy's group (mrl_lightning/mwra/sharding.py): a sharded 2-rank step equals one rank's.

Two gloo processes shard one tiny GPT-2 with FSDP2 over their group, each take half the
step's prompts and run ``policy_update`` with an auxiliary term that only rank 1 has (rank 0
runs an empty share of it, so both run the same collectives). Their full weights after one
momentum-SGD step must equal a single unsharded process's on the whole batch with the same term
(its share of the update bounded on the group's gradients), their checkpoint state is full
tensors that load into the unsharded model, and sampling runs on the full weights with a
different number of rows per rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import dp_worker
import fsdp_worker
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "Calculate 12 + 34.", "What is 9 - 7?"]
G, L = 3, 6
ADVANTAGES = torch.tensor([[1.0, -0.5, -0.25], [0.3, -1.2, 0.9], [0.0, 0.7, -0.7], [-1.0, 0.2, 0.4]])


def test_a_sharded_two_rank_step_equals_the_unsharded_one(invariant_lm_dir, tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    policy = dp_worker.build_policy(invariant_lm_dir, "dapo", G, L)
    torch.manual_seed(3)
    rollout = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                          num_generations=G, max_completion_length=L, temperature=0.7)
    torch.save({"rollout": rollout, "advantages": ADVANTAGES, "g": G}, tmp_path / "rollout.pt")
    mp.start_processes(fsdp_worker.run, args=(2, str(invariant_lm_dir), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    whole = dp_worker.build_policy(invariant_lm_dir, "dapo", G, L)
    before = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    aux_rows = [1 * G + k for k in range(G)]  # rank 1's first prompt is batch position 1 (strided shards)
    weights, metrics, _ = fsdp_worker.update(whole, rollout, ADVANTAGES.clone(),
                                             dp_worker.shard_rollout(rollout, aux_rows))
    assert metrics["probe/aux/p/grad_scale"] < 1.0  # the bound acted: the share was measured on the group's
    for r in ranks:
        assert r["metrics"]["probe/aux/p/grad_scale"] == pytest.approx(metrics["probe/aux/p/grad_scale"], rel=1e-5)
        for name, value in weights.items():
            # lr 0.5 times gradients equal within ~1e-6 (float32 sums in another order): 1e-5
            torch.testing.assert_close(r["weights"][name], value, rtol=0, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
            torch.testing.assert_close(r["again"][name], r["weights"][name], rtol=0, atol=0, msg=name)  # saved, loaded: the same
    assert max(float((weights[n] - before[n]).abs().max()) for n in weights) > 1e-2  # the step moved them
    for r in ranks:  # a forward-only (reference) model does not keep its root whole after a forward
        assert r["resident"]["reference_wte_sharded"], r["resident"]
    # the sharded run's checkpoint state (full tensors) loads into the unsharded model
    whole.model.load_state_dict(ranks[0]["full"]["model"])
    torch.testing.assert_close(dict(whole.model.named_parameters())["transformer.wte.weight"],
                               ranks[0]["weights"]["transformer.wte.weight"], rtol=0, atol=0)
