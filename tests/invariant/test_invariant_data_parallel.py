"""One policy on k data-parallel ranks == one rank on the whole batch (docs/mwra.md).

Two gloo processes each take a contiguous half of the step's prompts (whole groups),
sum their loss normalizers over the group (``Workers.group_sum``) and all-reduce the
gradients (``Workers.reduce_gradients``). After one SGD step their weights must equal
those of a single process that trained on the whole batch, for every ``loss_type``
(sequence- and token-normalized), with truncated completions masked. The same workers
also exchange SEE records, which must arrive in one order on every rank.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

import dp_worker
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "Calculate 12 + 34.", "What is 9 - 7?"]
G, L = 3, 6
LOSS_TYPES = ["dapo", "grpo", "dr_grpo"]
# [B = 4, G = 3]: not zero-mean per group on purpose.
ADVANTAGES = torch.tensor([[1.0, -0.5, -0.25], [0.3, -1.2, 0.9], [0.0, 0.7, -0.7], [-1.0, 0.2, 0.4]])


def test_two_data_parallel_ranks_equal_one_rank_on_the_whole_batch(invariant_lm_dir, tmp_path):
    policy = dp_worker.build_policy(invariant_lm_dir, "dapo", G, L)
    torch.manual_seed(3)
    rollout = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                          num_generations=G, max_completion_length=L, temperature=0.7)
    assert len(set(rollout.completion_mask.sum(1).tolist())) > 1 and "length" in rollout.finish_reasons
    torch.save({"rollout": rollout, "advantages": ADVANTAGES, "g": G}, tmp_path / "rollout.pt")
    mp.start_processes(dp_worker.run, args=(2, str(invariant_lm_dir), str(tmp_path), LOSS_TYPES), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    # The ranks saw disjoint, strided prompts whose union is the batch.
    assert ranks[0]["prompts"] == [0, 2] and ranks[1]["prompts"] == [1, 3]
    # Every rank got every record, in policy order then the batch's prompt order (the ranks'
    # strided shares interleaved back: batch position 2i is rank 0's i-th prompt, 2i + 1 rank 1's).
    expected = ["a/r0/0", "a/r1/0", "a/r0/1", "a/r1/1", "b/r0", "b/r1"]
    assert ranks[0]["exchange"] == ranks[1]["exchange"] == expected
    for loss_type in LOSS_TYPES:
        before = [p.detach().clone() for p in dp_worker.build_policy(invariant_lm_dir, loss_type, G, L).model.parameters()]
        whole = dp_worker.update(dp_worker.build_policy(invariant_lm_dir, loss_type, G, L), rollout, ADVANTAGES.clone())
        moved = max((w - b).abs().max().item() for w, b in zip(whole, before))
        assert moved > 1e-3, f"{loss_type}: the whole-batch step barely moved the weights ({moved})"
        for rank in ranks:
            for w, d in zip(whole, rank[loss_type]):
                torch.testing.assert_close(d, w, rtol=0, atol=1e-5, msg=f"{loss_type}: rank differs from 1-rank update")
