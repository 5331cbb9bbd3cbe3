"""GPU bench: rollout and update speed, MFU, memory against the plan, SGT's cost, TRL, a colocated pair.

    .venv/bin/python scripts/gpu_bench.py              # one CUDA GPU, under 8 minutes (estimated: never run on one)
    .venv/bin/python scripts/gpu_bench.py --dry-run    # CPU, tiny shapes, the same code path (~1 minute)

Packages beyond torch, transformers and lightning: the project's own dependencies (tokenizers,
reasoning-gym for the prompts, numpy) and, for the TRL row only, ``trl==1.16.0`` (the ``bench`` or
``dev`` extra; without it that row is skipped with a line saying so). Nothing from the hub: the
models are built here with random weights from the transformers config dicts below (the real shapes
and vocabulary sizes of Qwen2.5-0.5B, Qwen2.5-1.5B and Llama-3.2-1B) and a word-level tokenizer of
the same vocabulary size, written to a temporary folder. Written against torch 2.11 (the GPU image)
and 2.13: nothing newer is used.

For each model, in bf16 on one GPU, with the project's own components:

- ``rollout``: tokens/s (rows x decoding steps) of the project's HF engine
  (:class:`~mrl_lightning.rollout.HFGenerateEngine`, shared prefill, seeded draws, log-probs read
  per step) against a plain ``model.generate`` with the same prompts, completions and lengths, and
  of transformers' static KV cache (``cache_implementation="static"``, which ``generate`` compiles
  with ``torch.compile`` on a GPU; its first call, the compile, is timed apart), as a candidate
  engine option. The model is cast to bf16 for the three.
- ``update``: the project's loop (:class:`~mrl_lightning.loop.trainer.MRLTrainer`, one
  :class:`~mrl_lightning.policy.PolicyModule`, ``bf16-mixed``, fused AdamW, ``dapo``, beta 0, the
  ``none`` probe) for a few steps: the update's tokens/s and its MFU (6 x matmul parameters x the
  tokens the update computes, each distinct prompt once plus every completion, over the seconds and
  the chip's dense bf16 peak, :data:`PEAK_TFLOPS`), and the worker's peak memory (the CUDA
  allocator's) against the project's memory plan (:mod:`mrl_lightning.mwra.plan`): checked plan >=
  peak and plan <= 1.5 x peak.
- ``sgt``: SGT's own term (its forward, backward, share bound) at the 1.5B shape, as the update runs
  it (:func:`mrl_lightning.objectives.aux_share.backward_aux_losses`), over 2 demos, as a share of the
  loop's step.
- ``trl``: TRL 1.16's ``GRPOTrainer`` at the 1.5B shape with the same prompts, completions, lengths,
  loss, learning rate and precision: its step against ours.
- ``pair``: two policies of different shapes (0.5B Qwen, 1B Llama) colocated on the GPU: the pair's
  step and the worker's peak memory against the plan.

Prints one table and exits 1 when a check fails (a memory check, or a part that raised). In the dry
run the memory checks are reported, not enforced: a CPU's peak is the process's RSS, which every
earlier part of the script has grown. Reward: a hash of the text (random weights solve nothing; a
hash gives every group variance, hence a gradient).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `mrl` sets it, before torch is imported (docs/speed.md)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# The models' transformers configs (from each model's config.json; weights are random here).
SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, hidden_act="silu",
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                       "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
}
# --dry-run: the same families, tiny (a CPU runs every part in seconds)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048}
POLICY_NAMES = {"qwen2.5-0.5b": "qwen05b", "qwen2.5-1.5b": "qwen15b", "llama-3.2-1b": "llama1b"}
SGT_SHAPE, PAIR = "qwen2.5-1.5b", ("qwen2.5-0.5b", "llama-3.2-1b")
# Dense bf16 peak of a chip (no sparsity), TFLOP/s, by a piece of torch.cuda.get_device_name()
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "L4": 121.0, "A10G": 70.0}
TEMPLATE = "{question}\nAnswer:"
PLAN_SLACK = 1.5  # plan <= 1.5 x the measured peak (docs/mwra.md)


class Settings:
    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.precision = "32-true" if dry else "bf16-mixed"  # the dry run avoids CPUs without bf16 kernels
        self.dtype = torch.float32 if dry else torch.bfloat16
        self.prompts, self.generations = (2, 2) if dry else (8, 8)
        self.new_tokens = 8 if dry else 128
        self.steps, self.warmup = (2, 1) if dry else (3, 1)
        self.rounds = 1 if dry else 2


def shape(name: str, s: Settings) -> dict:
    cfg = dict(SHAPES[name])
    if s.dry:
        cfg.update(TINY)
        cfg.pop("head_dim", None)
    return cfg


# ------------------------------------------------------------------------- models and data
def data_module(s: Settings):
    from mrl_lightning.data import ReasoningGymDataModule
    from mrl_lightning.data.reasoning_gym import TaskPart

    part = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
            "allow_parentheses": False, "allow_negation": False}
    data = ReasoningGymDataModule([TaskPart("add", "basic_arithmetic", part)], batch_size=s.prompts,
                                  train_size=500, eval_size=4, seed=0)
    data.setup()
    return data


def write_model(folder: Path, cfg: dict, data, s: Settings) -> None:
    """A word-level tokenizer of the model's full vocabulary (the task's words, then fillers: every id
    decodes, so texts differ) and the model with random weights, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<unk>"]
    seen = set(words)
    for x in data.train_items("add"):
        for w in pre_tokenizers.Whitespace().pre_tokenize_str(TEMPLATE.format(question=x.question) + " " + x.answer):
            if w[0] not in seen:
                seen.add(w[0])
                words.append(w[0])
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), cfg["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>")
    tok.save_pretrained(str(folder))
    config = AutoConfig.for_model(**cfg, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if not s.dry else torch.float32)
    model.save_pretrained(str(folder))
    del model


def matmul_params(cfg: dict) -> int:
    """Parameters a token's forward multiplies by: every decoder layer's linear weights and the head."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * i) + cfg["vocab_size"] * h


def peak_tflops(s: Settings) -> float | None:
    if s.dry:
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def reset_memory(s: Settings) -> None:
    gc.collect()
    if not s.dry:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(s: Settings) -> float:
    from mrl_lightning.mwra.process import peak_memory_gib

    return peak_memory_gib(torch.device(s.device))


def sync(s: Settings) -> None:
    if not s.dry:
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ parts
def rollout_part(name: str, folder: Path, data, s: Settings) -> list[tuple]:
    """The HF engine, plain generate and the static-cache (compiled) generate on the same prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl_lightning.rollout import HFGenerateEngine
    from mrl_lightning.rollout.base import left_pad

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=s.dtype).to(s.device).eval()
    prompts = tok([TEMPLATE.format(question=x.question) for x in data.train_items("add")[:s.prompts]])["input_ids"]
    g, length, stops = s.generations, s.new_tokens, [tok.eos_token_id]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    ids, mask = ids.to(s.device), mask.long().to(s.device)

    def plain(static: bool) -> int:
        extra = {"cache_implementation": "static"} if static else {}
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_return_sequences=g,
                             max_new_tokens=length, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=tok.pad_token_id, eos_token_id=stops, **extra)
        return out[:, ids.shape[1]:].numel()

    def ours(seed: int) -> int:
        out = HFGenerateEngine().generate(model, tok, prompts, num_generations=g, max_completion_length=length,
                                          temperature=1.0, stop_token_ids=stops, sampling_draw="inverse_cdf",
                                          prompt_seeds=[seed * 1000 + i for i in range(len(prompts))])
        return out.completion_ids.numel()

    calls = {"ours": lambda r: ours(r), "plain": lambda r: plain(False), "static": lambda r: plain(True)}
    rates: dict[str, list[float]] = {k: [] for k in calls}
    first: dict[str, float] = {}
    with torch.no_grad():
        for round_ in range(s.rounds + 1):  # round 0 warms up (and compiles the static cache's forward)
            for key, call in calls.items():
                torch.manual_seed(round_)
                sync(s)
                t0 = time.perf_counter()
                tokens = call(round_)
                sync(s)
                elapsed = time.perf_counter() - t0
                if round_:
                    rates[key].append(tokens / elapsed)
                else:
                    first[key] = elapsed
    med = {k: statistics.median(v) for k, v in rates.items()}
    del model
    reset_memory(s)
    return [("rollout HF engine", name, f"{med['ours']:,.0f} tok/s", f"plain {med['plain']:,.0f}",
             f"{med['ours'] / med['plain']:.2f}x", "info"),
            ("rollout static+compile", name, f"{med['static']:,.0f} tok/s", f"plain {med['plain']:,.0f}",
             f"{med['static'] / med['plain']:.2f}x", f"first call {first['static']:.1f} s")]


def hash_reward():
    """1.0 when the SHA-256 of the text starts with an even byte (tests/e2e/e2e_rewards.py's HashReward)."""
    from mrl_lightning.rewards.base import RewardFunction

    class HashReward(RewardFunction):
        name, version, strict = "hash", "1", True

        def __call__(self, completions, items):
            return [float(hashlib.sha256(t.encode()).digest()[0] % 2 == 0) for t in completions]

    return HashReward()


def policy_for(name: str, folder: Path, s: Settings):
    from mrl_lightning.policy import PolicyModule

    return PolicyModule(name=POLICY_NAMES[name], model=str(folder), prompt_template=TEMPLATE, learning_rate=1e-6,
                        num_generations=s.generations, max_completion_length=s.new_tokens, temperature=1.0,
                        loss_type="dapo", beta=0.0, max_prompt_length=64, fused_optimizer=not s.dry,
                        sampling_draw="inverse_cdf")


def loop_part(names: list[str], folders: dict[str, Path], s: Settings, out: Path) -> dict:
    """The project's loop on one device, colocated: per-step seconds, phases, peak memory and the plan."""
    import mrl_lightning.mwra.plan as plan_module
    from mrl_lightning.callbacks import NoSharing
    from mrl_lightning.callbacks.base import MRLCallback
    from mrl_lightning.mwra.plan import worker_memory_gib
    from mrl_lightning.loop.system import MutualRL
    from mrl_lightning.loop.trainer import MRLTrainer

    steps: list[dict] = []
    marks = [0.0]

    class StepTimer(MRLCallback):
        def on_fit_start(self, trainer, system):
            sync(s)
            marks[0] = time.perf_counter()

        def on_train_step_end(self, trainer, system, metrics):
            sync(s)
            now = time.perf_counter()
            steps.append({"step": now - marks[0], **{k: float(v) for k, v in metrics.items()
                                                     if isinstance(v, (int, float))}})
            marks[0] = now

    rows: list = []
    footprint = [0.0]
    original = plan_module.build_plan

    def capture(*args, **kwargs):  # the plan's rows, and on a CPU its measured footprint, as plan_resources takes it
        rows[:] = original(*args, **kwargs)
        footprint[0] = plan_module.process_rss_bytes() / 2**30 if s.device == "cpu" else 0.0
        return rows

    reset_memory(s)
    policies = [policy_for(n, folders[n], s) for n in names]
    system = MutualRL(policies, reward_funcs=[hash_reward()])
    trainer = MRLTrainer(max_steps=s.steps, accelerator=s.device, devices=1, precision=s.precision,
                         default_root_dir=str(out / "runs"), callbacks=[NoSharing(), StepTimer()],
                         log_every_n_steps=10**6, eval_every_n_steps=10**6, checkpoint_every_n_steps=0,
                         eval_num_generations=0, num_sample_completions=0, enable_progress_bar=False,
                         num_threads=None, seed=0)
    trainer._evaluate = lambda *a, **k: None  # no held-out evaluation inside the timed loop
    trainer.save_checkpoint = lambda *a, **k: None  # nor a checkpoint of GBs at the end
    plan_module.build_plan = capture
    try:
        with contextlib.redirect_stdout(sys.stderr):
            trainer.fit(system, data_module(s))
    finally:
        plan_module.build_plan = original
    timed = steps[s.warmup:] or steps
    result = {"step_s": statistics.median(r["step"] for r in timed), "peak_gib": peak_gib(s),
              "plan_gib": worker_memory_gib(rows, 0, footprint[0]), "policies": {}}
    for p in policies:
        n = p.policy_name
        upd = statistics.median(r.get(f"mwra/{n}/update_s", 0.0) for r in timed)
        roll = statistics.median(r.get(f"mwra/{n}/rollout_s", 0.0) for r in timed)
        sampled = statistics.median(r.get(f"mwra/{n}/rollout_tokens_per_s", 0.0) * r.get(f"mwra/{n}/rollout_s", 0.0)
                                    for r in timed)
        result["policies"][n] = {"update_s": upd, "rollout_s": roll, "completion_tokens": sampled}
    del trainer, system, policies
    reset_memory(s)
    return result


def memory_row(what: str, model: str, r: dict, s: Settings) -> tuple:
    ratio = r["plan_gib"] / r["peak_gib"] if r["peak_gib"] else float("inf")
    ok = r["plan_gib"] >= r["peak_gib"] and ratio <= PLAN_SLACK
    check = ("ok" if ok else "FAIL") if not s.dry else f"cpu: not checked ({'ok' if ok else 'off'})"
    return (what, model, f"peak {r['peak_gib']:.2f} GiB", f"plan {r['plan_gib']:.2f} GiB", f"{ratio:.2f}x", check)


def update_rows(name: str, cfg: dict, r: dict, prompt_tokens: float, s: Settings) -> list[tuple]:
    (p,) = r["policies"].values()
    tokens = s.prompts * prompt_tokens + p["completion_tokens"]  # each distinct prompt once, every completion
    rate = tokens / p["update_s"] if p["update_s"] else 0.0
    peak = peak_tflops(s)
    mfu = f"MFU {100 * 6 * matmul_params(cfg) * rate / (peak * 1e12):.1f}%" if peak else "MFU n/a (peak unknown)"
    return [("update", name, f"{rate:,.0f} tok/s", f"step {r['step_s']:.2f} s", mfu, "info"),
            memory_row("memory, one worker", name, r, s)]


def sgt_part(folder: Path, s: Settings, step_s: float, prompt_tokens: int) -> tuple:
    """SGT's transfer term over 2 demos at the 1.5B shape, as the update runs it, against the loop's step."""
    from lightning.fabric import Fabric

    from mrl_lightning.builders import build_policy
    from mrl_lightning.callbacks.sgt_terms import _SGTTransferLoss
    from mrl_lightning.model.head_factors import factorable_weight
    from mrl_lightning.objectives.aux_share import backward_aux_losses
    from mrl_lightning.update.policy_update import term_attention
    from mrl_lightning.model.weight_casts import shared_casts

    policy = policy_for(SGT_SHAPE, folder, s)
    build_policy(policy)
    fabric = Fabric(accelerator=s.device, devices=1, precision=s.precision)
    model = fabric.setup_module(policy.model)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    demos = [(torch.randint(4, vocab, (prompt_tokens,), generator=g).tolist(),
              torch.randint(4, vocab, (s.new_tokens,), generator=g).tolist()) for _ in range(2)]
    term = _SGTTransferLoss(demos, 0.3, 1.0, "probe/sgt/bench", 0.3, policy.tokenizer.pad_token_id)
    factored = factorable_weight(policy)
    seconds = []
    for round_ in range(s.rounds + 1):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3  # a GRPO gradient to bound against
        with shared_casts(s.device):
            sync(s)
            t0 = time.perf_counter()
            with term_attention(fabric, [term]):
                backward_aux_losses([term], policy, model, fabric.backward, params, tag=lambda n: n,
                                    totals={"sgt_demos": 2.0}, factored_head=factored)
            sync(s)
            if round_:
                seconds.append(time.perf_counter() - t0)
    del model, policy, params
    reset_memory(s)
    t = statistics.median(seconds)
    return ("SGT term (2 demos)", SGT_SHAPE, f"{t:.3f} s", f"step {step_s:.2f} s", f"{100 * t / (step_s + t):.1f}% of a step",
            "info")


def trl_part(folder: Path, s: Settings, ours_step_s: float, out: Path) -> tuple:
    try:
        import trl  # noqa: F401
        from datasets import Dataset
    except ImportError:
        return ("TRL GRPOTrainer", SGT_SHAPE, "skipped", "-", "-", "trl not installed: pip install -e '.[bench]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    data = data_module(s)
    rows = [{"prompt": TEMPLATE.format(question=x.question)} for x in data.train_items("add")]
    scorer = hash_reward()

    def reward(prompts, completions, **kwargs):
        return scorer(list(completions), [None] * len(completions))

    config = GRPOConfig(output_dir=str(out / "trl"), use_cpu=s.dry, per_device_train_batch_size=s.prompts * s.generations,
                        num_generations=s.generations, max_completion_length=s.new_tokens, temperature=1.0,
                        top_p=1.0, top_k=0, learning_rate=1e-6, beta=0.0, loss_type="dapo", scale_rewards="group",
                        num_iterations=1, max_steps=s.steps, logging_steps=10**6, save_strategy="no", report_to=[],
                        seed=0, disable_dropout=True, bf16=not s.dry, dataloader_num_workers=0, max_grad_norm=1.0,
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                        optim="adamw_torch_fused" if not s.dry else "adamw_torch")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder))
    steps, marks = [], [0.0]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            sync(s)
            marks[0] = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            sync(s)
            steps.append(time.perf_counter() - marks[0])

    reset_memory(s)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[StepTimer()])
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    del trainer, model
    reset_memory(s)
    theirs = statistics.median(steps[s.warmup:] or steps)
    return ("step vs TRL 1.16", SGT_SHAPE, f"ours {ours_step_s:.2f} s", f"TRL {theirs:.2f} s",
            f"{ours_step_s / theirs:.2f}x", "info")


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the same code path")
    ap.add_argument("--only", nargs="*", default=None,
                    choices=["rollout", "update", "sgt", "trl", "pair"], help="run these parts only")
    args = ap.parse_args(argv)
    s = Settings(args.dry_run)
    if not s.dry and not torch.cuda.is_available():
        print("no CUDA GPU here: run with --dry-run for the CPU pass of the same code")
        return 2
    if s.dry:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    parts = set(args.only or ["rollout", "update", "sgt", "trl", "pair"])
    start = time.perf_counter()
    table: list[tuple] = []
    failed: list[str] = []

    def attempt(label: str, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a part that raises is a failed check, the others still run
            traceback.print_exc(file=sys.stderr)
            failed.append(label)
            table.append((label, "-", "raised", "-", "-", f"FAIL: {type(exc).__name__}: {str(exc)[:60]}"))
            return None

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = data_module(s)
        prompt_tokens = None
        folders: dict[str, Path] = {}
        for name in SHAPES:
            folders[name] = out / name
            write_model(folders[name], shape(name, s), data, s)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folders[SGT_SHAPE]))
        prompt_tokens = statistics.mean(len(tok(TEMPLATE.format(question=x.question))["input_ids"])
                                        for x in data.train_items("add")[:64])
        loops: dict[str, dict] = {}
        for name in SHAPES:
            if "rollout" in parts:
                rows = attempt(f"rollout {name}", lambda: rollout_part(name, folders[name], data, s))
                table.extend(rows or [])
            if "update" in parts or (name == SGT_SHAPE and parts & {"sgt", "trl"}):
                r = attempt(f"update {name}", lambda: loop_part([name], folders, s, out / name))
                if r is not None:
                    loops[name] = r
                    table.extend(update_rows(name, shape(name, s), r, prompt_tokens, s))
        step = loops.get(SGT_SHAPE, {}).get("step_s")
        if "sgt" in parts and step:
            table.append(attempt("sgt", lambda: sgt_part(folders[SGT_SHAPE], s, step, round(prompt_tokens)))
                         or ("SGT term", SGT_SHAPE, "-", "-", "-", "FAIL"))
        if "trl" in parts and step:
            table.append(attempt("trl", lambda: trl_part(folders[SGT_SHAPE], s, step, out))
                         or ("TRL", SGT_SHAPE, "-", "-", "-", "FAIL"))
        if "pair" in parts:
            r = attempt("pair", lambda: loop_part(list(PAIR), folders, s, out / "pair"))
            if r is not None:
                table.append(("pair step, colocated", " + ".join(PAIR), f"{r['step_s']:.2f} s",
                              " + ".join(f"{v['rollout_s'] + v['update_s']:.2f}" for v in r["policies"].values()),
                              "-", "info"))
                table.append(memory_row("memory, pair's worker", " + ".join(PAIR), r, s))
    total = time.perf_counter() - start
    table.append(("total time", "-", f"{total:.0f} s", "budget 480 s", f"{total / 480:.2f}x",
                  "info" if s.dry or total <= 480 else "over the 8 minutes aimed at"))
    failed += [f"{row[0]} {row[1]}" for row in table if str(row[5]).startswith("FAIL")]
    device = "CPU dry run (tiny shapes, not a GPU measurement)" if s.dry else torch.cuda.get_device_name(0)
    print(f"\n{device}; torch {torch.__version__}; {s.prompts} prompts x {s.generations} completions x "
          f"{s.new_tokens} tokens; {s.precision}; {s.steps} loop steps (first {s.warmup} left out); "
          f"{total:.0f} s")
    header = ("what", "model", "measured", "against", "ratio", "check")
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(6)]
    for row in [header, tuple("-" * w for w in widths), *table]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
    if failed:
        print(f"FAILED: {', '.join(dict.fromkeys(failed))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
