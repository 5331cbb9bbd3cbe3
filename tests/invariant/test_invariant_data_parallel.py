"""One policy on k data-parallel ranks == one rank on the whole batch (docs/mwra.md).

Two gloo processes each take a contiguous half of the step's prompts (whole groups),
sum their loss normalizers over the group (``Workers.group_sum``) and all-reduce the
gradients (``Workers.reduce_gradients``). After one SGD step their weights must equal
those of a single process that trained on the whole batch, for every ``loss_type``
(sequence- and token-normalized, the GRPO family, GSPO's sequence level) and with the
top-entropy mask (its quantile over both ranks' tokens), with truncated completions masked. The same workers
also exchange SEE records, which must arrive in one order on every rank.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

import dp_worker
from mrl_lightning.rollout import HFGenerateEngine

PROMPTS = ["Calculate 1 + 2.", "What is 7 - 5?\nAnswer:", "Calculate 12 + 34.", "What is 9 - 7?"]
G, L = 3, 6
# case -> the policy's options: sequence- and token-normalized loss types, GSPO's sequence level,
# the family's other terms, and the top-entropy mask, whose quantile is taken over both ranks' tokens
CASES = {"dapo": dict(loss_type="dapo"), "grpo": dict(loss_type="grpo"), "dr_grpo": dict(loss_type="dr_grpo"),
         "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1),
         "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
         "cispo": dict(loss_type="cispo", epsilon_high=5.0), "sapo": dict(loss_type="sapo"),
         "vespo": dict(loss_type="vespo"), "dapo-top-entropy": dict(loss_type="dapo", top_entropy_quantile=0.5)}
# [B = 4, G = 3]: not zero-mean per group on purpose.
ADVANTAGES = torch.tensor([[1.0, -0.5, -0.25], [0.3, -1.2, 0.9], [0.0, 0.7, -0.7], [-1.0, 0.2, 0.4]])


def test_two_data_parallel_ranks_equal_one_rank_on_the_whole_batch(invariant_lm_dir, tmp_path):
    policy = dp_worker.build_policy(invariant_lm_dir, "dapo", G, L)
    torch.manual_seed(3)
    rollout = HFGenerateEngine().generate(policy.model, policy.tokenizer, policy.encode_prompts(PROMPTS),
                                          num_generations=G, max_completion_length=L, temperature=0.7)
    assert len(set(rollout.completion_mask.sum(1).tolist())) > 1 and "length" in rollout.finish_reasons
    torch.save({"rollout": rollout, "advantages": ADVANTAGES, "g": G}, tmp_path / "rollout.pt")
    mp.start_processes(dp_worker.run, args=(2, str(invariant_lm_dir), str(tmp_path), CASES), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    # The ranks saw disjoint, strided prompts whose union is the batch.
    assert ranks[0]["prompts"] == [0, 2] and ranks[1]["prompts"] == [1, 3]
    # Every rank got every record, in policy order then the batch's prompt order (the ranks'
    # strided shares interleaved back: batch position 2i is rank 0's i-th prompt, 2i + 1 rank 1's).
    expected = ["a/r0/0", "a/r1/0", "a/r0/1", "a/r1/1", "b/r0", "b/r1"]
    assert ranks[0]["exchange"] == ranks[1]["exchange"] == expected
    for case, options in CASES.items():
        before = [p.detach().clone() for p in dp_worker.build_policy(invariant_lm_dir, g=G, length=L, **options)
                  .model.parameters()]
        whole = dp_worker.update(dp_worker.build_policy(invariant_lm_dir, g=G, length=L, **options), rollout,
                                 ADVANTAGES.clone())
        moved = max((w - b).abs().max().item() for w, b in zip(whole, before))
        assert moved > 1e-3, f"{case}: the whole-batch step barely moved the weights ({moved})"
        for rank in ranks:
            for w, d in zip(whole, rank[case]):
                torch.testing.assert_close(d, w, rtol=0, atol=1e-5, msg=f"{case}: rank differs from 1-rank update")
