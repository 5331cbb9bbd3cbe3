"""SGT's own pass on one real policy: the transfer term's forward, backward and bound, timed and profiled.

    python benchmarks/sgt_aux.py --policy gemma --demos 3 --prompt-tokens 20 --completion-tokens 15
    python benchmarks/sgt_aux.py --policy smollm2 --precision bf16-mixed --rounds 5
    python benchmarks/sgt_aux.py --policy smollm2 --precision bf16-mixed --demos 2 --prompt-tokens 45 \
        --completion-tokens 15 --compare-rows 16      # a demo token against a GRPO row's token

Builds the policy of ``configs/real_small.yaml`` (``pypi:`` models: the ``real`` extra and SmolLM2's
package, docs/real_models.md), puts a random float32 "GRPO gradient" in every ``.grad``, and times
:func:`mrl_lightning.objectives.aux_share.backward_aux_losses` with one SGT transfer term over
``--demos`` demos of random token ids: what ``train/<p>/aux_loss_time_s`` measures in a run (the
term's own forward and backward over its demo rows, both norms, the bound and the sum), with the
tied head's gradient kept as its factors as on one rank (``--materialize``: whole, as a group of
several ranks takes it). Then one call under ``torch.profiler``: the operators by their own time,
with their input shapes, so any ``[V, h]`` tensor of a tied head shows. One thread (the default
placement's), with torch's huge pages on as ``mrl`` runs them (``THP_MEM_ALLOC_ENABLE``; set it to 0
to see the difference). Time it alone (docs/probes.md, "Cost").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch is imported, as `mrl` sets it (docs/speed.md)

import torch  # noqa: E402

POLICIES = {
    "gemma": dict(model="pypi:gemma-3-270m", prompt_template="Question: {question}\nAnswer:", stop=["\n"]),
    "smollm2": dict(model="pypi:smollm2-135m-instruct", chat_template=True, prompt_template="{question}"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=sorted(POLICIES), default="gemma")
    parser.add_argument("--demos", type=int, default=3, help="demo rows of the transfer term")
    parser.add_argument("--prompt-tokens", type=int, default=20)
    parser.add_argument("--completion-tokens", type=int, default=15)
    parser.add_argument("--precision", default="32-true", help="Fabric precision (32-true or bf16-mixed)")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls after one warm-up call")
    parser.add_argument("--top", type=int, default=16, help="operators to list from the profile")
    parser.add_argument("--grpo-rows", type=int, default=16,
                        help="rows of a GRPO-like pass run before each timed call inside the same shared_casts "
                             "context, as the update runs them (0: none, the call casts every weight itself)")
    parser.add_argument("--compare-rows", type=int, default=0,
                        help="then time a GRPO-like forward and backward over this many rows of the demos' length, "
                             "and print both per token (0: not)")
    parser.add_argument("--materialize", action="store_true",
                        help="take the tied head's gradient whole, as a group of several ranks does (default: as "
                             "one rank does, its factors, mrl_lightning/model/head_factors.py)")
    args = parser.parse_args(argv)

    from lightning.fabric import Fabric
    from torch.profiler import ProfilerActivity, profile

    from mrl_lightning.builders import build_policy
    from mrl_lightning.callbacks.sgt_terms import _SGTTransferLoss
    from mrl_lightning.objectives.aux_share import backward_aux_losses
    from mrl_lightning.model.head_factors import factorable_weight
    from mrl_lightning.update.policy_update import term_attention
    from mrl_lightning.model.weight_casts import shared_casts
    from mrl_lightning.policy import PolicyModule

    torch.set_num_threads(1)
    policy = PolicyModule(name=args.policy, num_generations=4, max_prompt_length=64, max_completion_length=32,
                          loss_type="dapo", beta=0.0, **POLICIES[args.policy])
    build_policy(policy)
    fabric = Fabric(accelerator="cpu", devices=1, precision=args.precision)
    model = fabric.setup_module(policy.model)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    demos = [(torch.randint(100, 5000, (args.prompt_tokens,), generator=g).tolist(),
              torch.randint(100, 5000, (args.completion_tokens,), generator=g).tolist()) for _ in range(args.demos)]
    term = _SGTTransferLoss(demos, 0.3, 1.0, f"probe/sgt/{args.policy}", 0.3, policy.tokenizer.pad_token_id)
    start = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
    for p, g0 in zip(params, start):
        p.grad = g0.clone()

    factored = None if args.materialize else factorable_weight(policy)

    grpo = (torch.randint(100, 5000, (args.grpo_rows, args.prompt_tokens), generator=g),
            torch.randint(100, 5000, (args.grpo_rows, 2 * args.completion_tokens), generator=g))

    def grpo_pass() -> None:  # GRPO's forward and backward, its gradient then replaced by the random one
        if not args.grpo_rows:
            return
        p_ids, c_ids = grpo
        with fabric.autocast():
            logp, _ = policy.completion_logprobs(p_ids, torch.ones_like(p_ids, dtype=torch.bool), c_ids,
                                                 torch.ones_like(c_ids, dtype=torch.bool), model=model)
        fabric.backward(logp.mean())
        for p, g0 in zip(params, start):
            p.grad = g0.clone()

    def once(timed: list | None = None) -> dict:
        with shared_casts("cpu"):  # as the update (mrl_lightning/update/policy_update.py): one cast per weight
            grpo_pass()
            t0 = time.perf_counter()
            with term_attention(fabric, [term]):  # as the update
                out = backward_aux_losses([term], policy, model, fabric.backward, params, tag=lambda name: name,
                                          totals={"sgt_demos": float(args.demos)}, factored_head=factored)
            if timed is not None:
                timed.append(time.perf_counter() - t0)
        return out

    once()
    seconds: list[float] = []
    for _ in range(args.rounds):
        metrics = once(seconds)
    how = "materialized" if factored is None else "factored"
    print(f"{args.policy} ({args.precision}, head gradient {how}): {args.demos} demos x "
          f"({args.prompt_tokens} + {args.completion_tokens}) tokens: {statistics.median(seconds):.3f} s a call "
          f"(median of {args.rounds}, least {min(seconds):.3f}: {', '.join(f'{s:.3f}' for s in seconds)}); "
          f"share {metrics['sgt/grad_share']:.3f}", flush=True)
    if args.compare_rows:
        per_token = statistics.median(seconds) / (args.demos * (args.prompt_tokens + args.completion_tokens))
        p_ids = torch.randint(100, 5000, (args.compare_rows, args.prompt_tokens), generator=g)
        c_ids = torch.randint(100, 5000, (args.compare_rows, args.completion_tokens), generator=g)
        rows_s = []
        for _ in range(args.rounds + 1):  # the first one warms the shapes up
            with shared_casts("cpu"):
                t0 = time.perf_counter()
                with fabric.autocast():
                    logp, _ = policy.completion_logprobs(p_ids, torch.ones_like(p_ids, dtype=torch.bool), c_ids,
                                                         torch.ones_like(c_ids, dtype=torch.bool), model=model)
                fabric.backward(logp.mean())
                rows_s.append(time.perf_counter() - t0)
            for p, g0 in zip(params, start):
                p.grad = g0.clone()
        rows_median = statistics.median(rows_s[1:])
        tokens = args.compare_rows * (args.prompt_tokens + args.completion_tokens)
        print(f"GRPO-like forward and backward, {args.compare_rows} rows x {args.prompt_tokens + args.completion_tokens}"
              f" tokens: {rows_median:.3f} s ({1e3 * rows_median / tokens:.2f} ms a token); the term's call: "
              f"{1e3 * per_token:.2f} ms a demo token, its norms, bound and sum included", flush=True)
    with shared_casts("cpu"):
        grpo_pass()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, term_attention(fabric, [term]):
            backward_aux_losses([term], policy, model, fabric.backward, params, tag=lambda name: name,
                                totals={"sgt_demos": float(args.demos)}, factored_head=factored)
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    for e in events[:args.top]:
        print(f"  {e.key[:40]:40s} {e.self_cpu_time_total / 1e3:9.1f} ms x{e.count:<4d} {str(e.input_shapes)[:70]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
