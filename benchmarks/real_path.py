"""A CPU rehearsal of the real path: two policies of tens of millions of parameters with production
tokenizers, chat templates and math-verify rewards on GSM8K / MATH lines, a few GRPO steps.

    python benchmarks/real_path.py --steps 4 --out runs/bench_real_path

What ``configs/gsm8k_math_qwen_llama.yaml`` does on a GPU, at a size a 2-core CPU can run:

- ``qwen``: a Qwen2-style model (Qwen2.5-0.5B-Instruct's shape scaled down: grouped-query
  attention with one key/value head per four query heads, an MLP 5.5x the width, RoPE base
  1e6, RMS-norm eps 1e-6, tied embeddings; width 256, 4 layers) with Mistral's real Tekken
  tokenizer (131,072 tokens) in Qwen2's ChatML chat format (turn ends with ``<|im_end|>``);
- ``llama``: a Llama-style model (Llama-3.2-1B-Instruct's shape scaled down: 4 query heads per
  key/value head, MLP 4x, RoPE base 5e5 without Llama 3's long-context scaling, eps 1e-5,
  tied; width 512, 4 layers) with Mistral's real v1 SentencePiece tokenizer (32,000 tokens) in
  Llama 3's chat format (turn ends with ``<|eot_id|>``);

built by ``TinyCausalLM`` (its ``config_overrides``) and briefly warm-started on the answer
format (``--warm-start-steps`` supervised steps, answers ``\\boxed{...}`` + end of turn; 0 =
random weights). Both prompt through their chat templates with the GPU config's system prompt,
train on the shipped GSM8K / MATH samples (``tests/data_samples``, the GPU config's keys, as
``configs/gsm8k_tiny.yaml``), are rewarded by ``MathVerifyReward``, sample up to
``--max-completion-length`` (>= 128) tokens, and pool each other's rollouts with PRP, so that
THL maps log-probs between the two real vocabularies at every step (``thl/prp/<p>/*``). One
worker process per policy (disjoint placement, one thread each: 2 cores), as on two GPUs.

Two phases. ``prepare`` builds both models into the recipe cache (the warm-start) in this
process and measures every prompt in each policy's own encoding, so that
``max_prompt_length`` holds the longest (no prompt is cut). ``run`` is ``mrl fit`` on cache
hits, so each worker's peak RSS is that of training, not of building. It prints:

- per worker, seconds per step by phase (``mwra/<p>/rollout_s``, ``update_s``, ``wait_s``;
  inside them the exchange phase (SEE publishing, ``train/exchange_time_s``: its collective, so a
  worker's wait for a slower one's rollouts, is in it), PRP composing and PRP's loss term), and
  the step time;
- tokens per second: completion tokens sampled per rollout second, and completion tokens
  trained per update second;
- peak RSS per worker over the whole run (its final evaluation and checkpoint included; the
  logged ``mwra/<p>/peak_memory_gib`` stops at the last step) against the plan's estimate for
  that worker (the printed plan): the estimate must hold as an upper bound within 1.5x; and
  the phase that set the peak (the run's workers record their peak RSS at the end of every
  phase: ``mrl fit`` is started through this file, which wraps ``Workers.phase``);
- THL residuals between Tekken and Mistral v1 (``thl/prp/<p>/*``, means over steps);
- the share of completions that ended at a stop token (finish ``stop``) and at the chat
  format's end-of-turn token itself, read from the SEE log of every rollout.

A JSON summary goes to ``<out>/real_path.json``. The models are random or barely warm-started,
so success is about 0: this rehearses the path and its costs, not learning. Time it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from mwra import read  # noqa: E402  (benchmarks/mwra.py)

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
POSITIONS = 1024
MODELS = {
    "qwen": {"family": "qwen2", "tokenizer_kind": "tekken", "hidden_size": 256, "num_layers": 4, "num_heads": 4,
             "config_overrides": {"intermediate_size": 1408, "num_key_value_heads": 1, "rms_norm_eps": 1e-6,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                  "max_position_embeddings": POSITIONS}},
    "llama": {"family": "llama", "tokenizer_kind": "mistral_v1", "hidden_size": 512, "num_layers": 4, "num_heads": 8,
              "config_overrides": {"intermediate_size": 2048, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
                                   "max_position_embeddings": POSITIONS}},
}
WARM_PART = {"qwen": "gsm8k", "llama": "math"}


def data_config() -> dict:
    """The twin's data (configs/gsm8k_tiny.yaml): the samples with the GPU config's keys."""
    return yaml.safe_load((REPO / "configs" / "gsm8k_tiny.yaml").read_text())["data"]


def config(args, max_prompt_length: int) -> dict:
    """The run's whole config."""
    policies = []
    for name, model in MODELS.items():
        recipe = dict(model, warm_start_part=WARM_PART[name] if args.warm_start_steps else None,
                      warm_start_steps=max(args.warm_start_steps, 1), warm_start_target=0.0,
                      warm_start_val_size=2, warm_start_batch_size=8, eval_every=max(args.warm_start_steps, 1),
                      warm_start_lr=1e-3)
        policies.append({"class_path": "mrl_lightning.policy.PolicyModule", "init_args": {
            "name": name, "model": {"class_path": "mrl_lightning.recipes.TinyCausalLM", "init_args": recipe},
            "chat_template": True, "system_prompt": SYSTEM_PROMPT, "prompt_template": "{question}",
            "completion_template": "\\boxed{{{answer}}}", "learning_rate": 1e-5, "num_generations": 4,
            "max_prompt_length": max_prompt_length, "max_completion_length": args.max_completion_length,
            "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group",
            # random models rarely stop: masking their truncated completions would leave the update no
            # tokens and hide its cost (the GPU config masks them)
            "mask_truncated_completions": False, "micro_batch_size": args.micro_batch_size}})
    return {
        "seed_everything": 0,
        "trainer": {"max_steps": args.steps, "accelerator": "cpu", "devices": 2, "strategy": "ddp",
                    "placement": "disjoint", "num_threads": 1, "log_every_n_steps": 1,
                    "eval_every_n_steps": args.steps, "eval_num_generations": 0, "num_sample_completions": 2,
                    "checkpoint_every_n_steps": 0, "enable_progress_bar": False,
                    "default_root_dir": str(args.out / "run"), "version": "run",
                    "callbacks": [
                        {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange", "init_args": {
                            "record_types": ["rollout"], "max_staleness": 0, "max_staleness_by_type": None,
                            "rollouts_of_successes_only": False, "capacity": 100000, "max_bytes": None,
                            "log_path": "see.jsonl"}},
                        {"class_path": "mrl_lightning.callbacks.PeerRolloutPooling", "init_args": {
                            "max_peers_per_prompt": args.prp_peers, "is_mode": "truncate", "is_level": "token", "c": 1.0,
                            "lambda_prp": 1.0, "lambda_per_policy": None, "max_staleness": 0, "sources": None,
                            "receivers": None, "eps": 1e-4}}]},
        "model": {"reward_funcs": [{"class_path": "mrl_lightning.rewards.MathVerifyReward",
                                    "init_args": {"executor": "auto", "max_workers": 1}}],
                  "policies": policies},
        "data": data_config(),
    }


def prepare(cfg: dict, cache: Path) -> dict[str, dict]:
    """Build both models into the cache (this process) and measure every prompt in each one's encoding.

    Returns:
        Policy name -> ``{"folder", "longest_prompt", "vocab", "end_of_turn_id", "build_s"}``.
    """
    import importlib

    os.environ["MRL_CACHE_DIR"] = str(cache)
    from transformers import AutoTokenizer

    from mrl_lightning.model.chat import encode_rendered, end_of_turn_id
    from mrl_lightning.policy import PolicyModule

    def build(spec):
        module, _, cls = spec["class_path"].rpartition(".")
        return getattr(importlib.import_module(module), cls)(**spec.get("init_args", {}))

    data = build(cfg["data"])
    data.setup()
    items = [x for p in data.parts for x in data.train_items(p.name)]
    items += [x for xs in data.eval_items().values() for x in xs]
    out = {}
    for spec in cfg["model"]["policies"]:
        init = dict(spec["init_args"])
        policy = PolicyModule(model=build(init.pop("model")), **init)
        start = time.perf_counter()
        folder = policy.model_source.materialize(policy, data, log=lambda line: print("  " + line, flush=True))
        policy.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        lengths: list[int] = []
        encode_rendered(policy.tokenizer, [policy.render_prompt(x) for x in items], 10**6, full_lengths=lengths)
        out[policy.policy_name] = {"folder": str(folder), "longest_prompt": max(lengths), "vocab": len(policy.tokenizer),
                                   "end_of_turn_id": end_of_turn_id(policy.tokenizer),
                                   "build_s": time.perf_counter() - start}
    return out


def plan_estimates(log: str) -> list[float]:
    """The plan's estimated GiB per worker, in rank order, from the run's console output.

    Raises:
        SystemExit: the plan's totals line is not in the output.
    """
    match = re.search(r"estimated GiB per worker incl\..*?: (rank 0: .*)", log)
    if not match:
        raise SystemExit("the resource plan's 'estimated GiB per worker' line is not in the run's output")
    return [float(x) for x in re.findall(r"rank \d+: ([0-9.]+)", match.group(1))]


def stop_shares(log_path: Path, ends: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per policy, from the SEE log of every rollout: completions, the share with finish 'stop', and the
    share whose last token is the policy's end-of-turn token."""
    from mrl_lightning.exchange.log import read_log

    out: dict[str, dict[str, float]] = {}
    for record in read_log(str(log_path)):
        if getattr(record, "record_type", "") != "rollout":
            continue
        row = out.setdefault(record.source, {"completions": 0, "stop": 0, "end_of_turn": 0})
        row["completions"] += 1
        row["stop"] += record.finish_reason in ("stop", "eos")
        row["end_of_turn"] += bool(record.token_ids) and record.token_ids[-1] == ends[record.source]
    for row in out.values():
        row["stop_share"] = row["stop"] / max(row["completions"], 1)
        row["end_of_turn_share"] = row["end_of_turn"] / max(row["completions"], 1)
    return out


def mean_after(scalars: dict, tag: str, skip: int) -> float | None:
    """Mean of a tag's values logged after step ``skip`` (None when absent)."""
    values = [v for step, _, v in scalars.get(tag, []) if step > skip]
    return statistics.fmean(values) if values else None


def summarize(scalars: dict, completions: dict[str, int], skip: int, estimates: list[float]) -> dict:
    """The printed numbers, per policy (rank r runs policy r; ``completions``: policy -> B x G a step, each
    worker running its policy on the whole batch)."""
    out = {"step_time_s": mean_after(scalars, "train/step_time_s", skip), "exchange_s":
           mean_after(scalars, "train/exchange_time_s", skip), "policies": {}}
    for rank, name in enumerate(completions):
        get = lambda tag: mean_after(scalars, tag, skip)  # noqa: E731
        rollout, update = get(f"mwra/{name}/rollout_s"), get(f"mwra/{name}/update_s")
        length = get(f"rollout/{name}/completion_length_tokens")
        peak = max((v for _, _, v in scalars.get(f"mwra/{name}/peak_memory_gib", [])), default=None)
        row = {"rollout_s": rollout, "update_s": update, "wait_s": get(f"mwra/{name}/wait_s"),
               "compose_s": get(f"train/{name}/compose_time_s"), "prp_loss_s": get(f"train/{name}/aux_loss_time_s"),
               "sampled_tokens_per_s": get(f"mwra/{name}/rollout_tokens_per_s"),
               "completion_length_tokens": length, "truncated_share": get(f"rollout/{name}/truncated_share"),
               "reward_mean": get(f"rollout/{name}/reward_mean"), "peak_rss_gib": peak,
               "plan_estimate_gib": estimates[rank] if rank < len(estimates) else None}
        row["trained_tokens_per_s"] = length * completions[name] / update if length and update else None
        thl = f"thl/prp/{name}/"
        row["thl"] = {tag[len(thl):]: mean_after(scalars, tag, 0) for tag in scalars if tag.startswith(thl)}
        out["policies"][name] = row
    return out


def fit_recording_phases(argv: list[str]) -> int:
    """``mrl fit`` with every worker appending ``phase step peak_rss_gib current_rss_gib`` at the end of each
    phase to ``$REAL_PATH_PHASES.rank<r>`` (Fabric starts the other workers with this same command line)."""
    import contextlib
    import os
    import resource

    from mrl_lightning.mwra import workers

    plain = workers.Workers.phase

    @contextlib.contextmanager
    def phase(self, name, step=None):
        with plain(self, name, step):
            yield
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        with open("/proc/self/statm") as fh:
            now = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
        with open(f"{os.environ['REAL_PATH_PHASES']}.rank{self.rank}", "a") as fh:
            fh.write(f"{name} {self.step} {peak:.4f} {now:.4f}\n")

    workers.Workers.phase = phase
    from mrl_lightning.cli import main as cli_main

    return cli_main(argv)


def phase_peaks(prefix: Path, ranks: int) -> list[dict]:
    """Per rank: the phase at whose end the peak RSS first reached its maximum, and the maximum per phase."""
    out = []
    for rank in range(ranks):
        rows = [line.split() for line in Path(f"{prefix}.rank{rank}").read_text().splitlines()]
        by_phase: dict[str, float] = {}
        first_at, best = None, -1.0
        for name, step, peak, _ in rows:
            by_phase[name] = max(by_phase.get(name, 0.0), float(peak))
            if float(peak) > best:
                best, first_at = float(peak), f"{name} (step {step})"
        out.append({"peak_set_by": first_at, "peak_gib": best, "peak_after_phase": by_phase})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps (timed from --skip on)")
    parser.add_argument("--skip", type=int, default=1, help="steps left out of the means (the first is slower)")
    parser.add_argument("--warm-start-steps", type=int, default=40, help="supervised steps on the format; 0 = random")
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--prp-peers", type=int, default=2, help="peer rollouts PRP pools per prompt (M)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_real_path")
    parser.add_argument("--cache", type=Path, default=None, help="recipe cache (default: <out>/cache)")
    args = parser.parse_args()
    if args.max_completion_length < 128:
        parser.error(f"--max-completion-length {args.max_completion_length}: the rehearsal samples >= 128 tokens")
    if args.steps <= args.skip:
        parser.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or args.out / "cache"
    wall = time.perf_counter()

    print(f"[prepare] building both models into {cache} (warm-start {args.warm_start_steps} steps)", flush=True)
    built = prepare(config(args, 2), cache)
    longest = max(b["longest_prompt"] for b in built.values())
    max_prompt = -(-longest // 16) * 16
    if max_prompt + args.max_completion_length > POSITIONS:
        raise SystemExit(f"the longest prompt ({longest} tokens) + {args.max_completion_length} exceeds the models' "
                         f"{POSITIONS} positions; raise POSITIONS")
    for name, b in built.items():
        print(f"[prepare] {name}: vocab {b['vocab']}, longest prompt {b['longest_prompt']} tokens, built in "
              f"{b['build_s']:.0f} s", flush=True)
    cfg = config(args, max_prompt)
    (args.out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    print(f"[run] mrl fit, {args.steps} steps, max_prompt_length {max_prompt}", flush=True)
    start = time.perf_counter()
    phases = args.out / "phases"
    for old in args.out.glob("phases.rank*"):
        old.unlink()
    with open(args.out / "run.log", "w") as log:
        code = subprocess.call([sys.executable, str(Path(__file__).resolve()), "_fit", "fit", "--config",
                                str(args.out / "config.yaml")], stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                               env={**os.environ, "MRL_CACHE_DIR": str(cache), "REAL_PATH_PHASES": str(phases)})
    run_s = time.perf_counter() - start
    text = (args.out / "run.log").read_text()
    if code:
        raise SystemExit(f"mrl fit failed with exit code {code}; see {args.out / 'run.log'}")
    if "longer than max_prompt_length" in text:
        raise SystemExit(f"a prompt was cut; see {args.out / 'run.log'}")
    folder = args.out / "run" / "run"
    completions = {p["init_args"]["name"]: cfg["data"]["init_args"]["batch_size"] * p["init_args"]["num_generations"]
                   for p in cfg["model"]["policies"]}
    summary = summarize(read(folder), completions, args.skip, plan_estimates(text))
    summary["phases"] = phase_peaks(phases, len(MODELS))
    for row, peaks in zip(summary["policies"].values(), summary["phases"]):
        # the worker's peak over the whole run: the logged one stops at the last step's metrics, before
        # the final evaluation and checkpoint
        row["run_peak_rss_gib"] = peaks["peak_gib"]
        if row["plan_estimate_gib"]:
            row["estimate_over_peak"] = row["plan_estimate_gib"] / peaks["peak_gib"]
    summary["stops"] = stop_shares(folder / "see.jsonl", {n: b["end_of_turn_id"] for n, b in built.items()})
    summary.update(built=built, max_prompt_length=max_prompt, run_s=run_s, wall_s=time.perf_counter() - wall,
                   plan=[line for line in text.splitlines() if line.startswith(("policy", "qwen", "llama", "estimated"))],
                   eval_lines=[line for line in text.splitlines() if line.startswith("[eval]")])
    (args.out / "real_path.json").write_text(json.dumps(summary, indent=2))
    report(summary, args)


def report(s: dict, args) -> None:
    """Print the summary."""
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    print("\n".join(s["plan"]))
    print(f"\nsteps {args.skip + 1}-{args.steps}, one worker per policy, 1 thread each; step {fmt(s['step_time_s'])} s, "
          f"exchange phase {fmt(s['exchange_s'])} s (SEE publishing; mean over workers, the faster one's wait for "
          "the slower one's rollouts included)")
    print("policy  rollout_s  update_s  (PRP compose / loss)  wait_s  sampled tok/s  trained tok/s  completion len  "
          "peak RSS GiB (steps / run)  plan GiB  plan/peak")
    for name, r in s["policies"].items():
        print(f"{name:6}  {fmt(r['rollout_s']):>9}  {fmt(r['update_s']):>8}  {fmt(r['compose_s'])} / "
              f"{fmt(r['prp_loss_s']):<8}       {fmt(r['wait_s']):>6}  {fmt(r['sampled_tokens_per_s'], '.1f'):>13}  "
              f"{fmt(r['trained_tokens_per_s'], '.1f'):>13}  {fmt(r['completion_length_tokens'], '.1f'):>14}  "
              f"{fmt(r['peak_rss_gib']):>13} / {fmt(r['run_peak_rss_gib']):<10}  {fmt(r['plan_estimate_gib']):>8}  "
              f"{fmt(r.get('estimate_over_peak'), '.2f'):>9}")
    for name, r in s["policies"].items():
        t = r["thl"]
        print(f"THL into {name} (thl/prp/{name}/, mean over steps): " + ", ".join(
            f"{k} {fmt(t.get(k), '.4g')}" for k in ("num_sequences", "boundary_agreement", "tokens_per_chunk",
                                                     "logprob_mass_moved", "logprob_mass_moved_nats",
                                                     "max_conservation_error", "round_trip_failures")))
    for name, r in s["stops"].items():
        print(f"{name}: {r['completions']} completions, finish 'stop' {r['stop_share']:.3f}, ended at its end of turn "
              f"{r['end_of_turn_share']:.3f}; reward mean {fmt(s['policies'][name]['reward_mean'])}")
    print("\n".join(s["eval_lines"]))
    for name, p in zip(s["policies"], s["phases"]):
        print(f"{name}: peak RSS {p['peak_gib']:.3f} GiB first reached by the end of {p['peak_set_by']}; peak after "
              "each phase: " + ", ".join(f"{k} {v:.2f}" for k, v in p["peak_after_phase"].items()))
    ok = all(r.get("estimate_over_peak") and 1.0 <= r["estimate_over_peak"] <= 1.5 for r in s["policies"].values())
    print(f"plan estimate within [1, 1.5] x the run's peak RSS on every worker: {ok}")
    print(f"wall {s['wall_s']:.0f} s (mrl fit {s['run_s']:.0f} s); summary: {args.out / 'real_path.json'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["_fit"]:  # a worker of the run (and the other workers Fabric starts alike)
        sys.exit(fit_recording_phases(sys.argv[2:]))
    main()
