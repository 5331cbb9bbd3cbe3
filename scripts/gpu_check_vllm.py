"""GPU check of the vLLM rollout engine: a few GRPO steps of a small local model, real vLLM.

Run on a CUDA machine where ``pip install -e '.[vllm]'`` was done beforehand; this script
installs nothing and downloads nothing (the model and tokenizer are built here from a
config, in a temporary folder):

    python scripts/gpu_check_vllm.py [--steps 3] [--family llama] [--out DIR] [--require-vllm]

or, from another script, ``from gpu_check_vllm import run_check`` (with ``scripts/`` on the
path) and use its exit code. Each step: the engine samples (pushing the weights first
when they changed), the update re-scores the rollouts, corrects the mismatch and takes an
AdamW step at a large learning rate. Checks (exit code 1 when one fails):

- step 0: the mean importance ratio (trainer over vLLM, per counted token) is within
  ``--tolerance`` (1e-2) of 1;
- every later step: the same bound, and the update of the step before moved the trainer's
  log-probs by more than ten times the sampler/trainer difference (so a stale engine would
  have been caught);
- after every push, every parameter vLLM holds under a Hugging Face name (embeddings, norms,
  unfused projections) equals the trainer's, rounded to vLLM's dtype; at least one is compared.

Printed per step: seconds per phase (push, sample, update), sampled tokens per second, the
ratio statistics and ``|delta logp|`` (nats), and the peak GPU memory; with ``--out`` the
same numbers and the failures go to ``DIR/vllm_check.json``. Exit code 0 also when
CUDA or vLLM is missing (the check is skipped, and says so) unless ``--require-vllm``
(then 2). See docs/rollout.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

CORPUS = ["What is 7 - 5?", "Calculate 12 + 34.", "Answer: 46", "The sum of 3 and 4 is 7."] * 25
PROMPTS = ["What is 7 - 5?", "Calculate 12 + 34.", "The sum of 3 and 4 is", "Answer:"]


def build_model(folder: Path, family: str) -> str:
    """A 2-layer model of ``family`` (llama, qwen2, gpt2) with a byte-level BPE trained here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl_lightning.recipes.tokenizers import train_byte_level_bpe

    tok = train_byte_level_bpe(CORPUS, 320, folder)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=len(tok), n_embd=256, n_layer=2, n_head=4, n_positions=512,
                                      **ids)
    else:
        config = AutoConfig.for_model(family, vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=512, tie_word_embeddings=False, **ids)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return str(folder)


def compare_engine_weights(engine, model) -> tuple[int, list[str]]:
    """(tensors compared, names that differ) between vLLM's parameters and the trainer's, by name."""
    theirs = engine.backend.named_parameters()
    compared, differ = 0, []
    for name, p in model.named_parameters():
        v = theirs.get(name)
        if v is None or v.dim() != p.dim() or v.shape[1:] != p.shape[1:] or v.shape[0] < p.shape[0]:
            continue  # fused or renamed inside vLLM (qkv_proj, gate_up_proj): not comparable by name
        compared += 1
        if not bool((v[: p.shape[0]] == p.detach().to(v.dtype)).all()):
            differ.append(name)
    return compared, differ


def run_check(steps: int = 3, family: str = "llama", dtype: str = "bfloat16", precision: str = "bf16-mixed",
              learning_rate: float = 3e-3, tolerance: float = 1e-2, require_vllm: bool = False,
              accelerator: str = "cuda", factory=None, device_memory_gib: float | None = None,
              out_dir: Path | None = None) -> int:
    """Run the check; returns the exit code (module docstring).

    ``accelerator``, ``factory`` and ``device_memory_gib`` (see
    :func:`mrl_lightning.builders.engines.build_vllm_engine`) let the project's tests run
    this same check on a CPU against their double of vLLM.
    """
    import torch

    if factory is None and (not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None):
        what = "CUDA" if not torch.cuda.is_available() else "vllm (pip install -e '.[vllm]')"
        print(f"SKIPPED: the vLLM engine check needs {what}, not available here.")
        return 2 if require_vllm else 0
    from lightning.fabric import Fabric

    from mrl_lightning.update.batch import TrainBatch
    from mrl_lightning.builders import build_policy, build_vllm_engine
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.update.policy_update import policy_update

    failures: list[str] = []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mrl_vllm_check_") as tmp:
        folder = build_model(Path(tmp), family)
        policy = PolicyModule(name=family, model=folder, rollout_engine="vllm", temperature=0.7, num_generations=8,
                              max_prompt_length=64, max_completion_length=32, learning_rate=learning_rate,
                              vllm_dtype=dtype)
        fabric = Fabric(accelerator=accelerator, devices=1, precision=precision)
        build_policy(policy)
        wrapped, opt = fabric.setup(policy.model, policy.configure_optimizers())
        t0 = time.perf_counter()
        engine = build_vllm_engine(policy, [policy], len(PROMPTS), factory=factory, device_memory_gib=device_memory_gib)
        print(f"engine built in {time.perf_counter() - t0:.1f} s")
        prompt_ids = policy.encode_prompts(PROMPTS)
        moved = None
        for step in range(steps):
            torch.manual_seed(step)
            t0 = time.perf_counter()
            pushes = engine.pushes
            out = engine.generate(policy.model, policy.tokenizer, prompt_ids, num_generations=policy.num_generations,
                                  max_completion_length=policy.max_completion_length, temperature=policy.temperature)
            sample_s = time.perf_counter() - t0 - (engine.last_push_s if engine.pushes > pushes else 0.0)
            if engine.pushes > pushes:
                compared, differ = compare_engine_weights(engine, policy.model)
                if not compared or differ:
                    failures.append(f"step {step}: engine weights differ from the trainer's after a push: "
                                    f"{differ or 'no parameter comparable by name'}")
            elif step > 0:
                failures.append(f"step {step}: no weight push after an optimizer step (stale engine)")
            tokens = int(out.completion_mask.sum())
            advantages = torch.randn(len(PROMPTS), policy.num_generations)
            t1 = time.perf_counter()
            metrics = policy_update(policy, TrainBatch(SimpleNamespace(rollouts=out), advantages), wrapped, fabric, opt)
            update_s = time.perf_counter() - t1
            p = policy.policy_name
            ratio, delta = metrics[f"rollout/{p}/is_ratio_mean"], metrics[f"rollout/{p}/abs_delta_logp"]
            print(f"step {step}: push {engine.last_push_s:.3f} s, sample {sample_s:.3f} s "
                  f"({tokens / max(sample_s, 1e-9):.0f} tok/s), update {update_s:.3f} s; is_ratio mean {ratio:.5f} "
                  f"max {metrics[f'rollout/{p}/is_ratio_max']:.4f}; |delta logp| mean {delta:.2e} "
                  f"max {metrics[f'rollout/{p}/abs_delta_logp_max']:.2e} nats; peak GPU memory "
                  f"{torch.cuda.max_memory_allocated() / 2**30 if accelerator == 'cuda' else 0.0:.2f} GiB")
            rows.append({"step": step, "push_s": engine.last_push_s, "sample_s": sample_s, "update_s": update_s,
                         "tokens": tokens, **{k: v for k, v in metrics.items() if k.startswith("rollout/")},
                         "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30
                         if accelerator == "cuda" else 0.0})
            if abs(ratio - 1.0) > tolerance:
                failures.append(f"step {step}: mean importance ratio {ratio:.5f} is more than {tolerance} from 1")
            if moved is not None and not moved > 10 * delta:
                failures.append(f"step {step}: the previous update moved log-probs by {moved:.2e} nats, not > 10 x "
                                f"the sampler/trainer difference {delta:.2e}: raise --lr for a check with power")
            with torch.no_grad():  # how far this step's update moves the trainer's log-probs of these rollouts
                after, _ = policy.completion_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids,
                                                      out.completion_mask, model=wrapped)
            m = out.completion_mask
            moved = float((after - out.old_logprobs)[m].abs().mean())
            print(f"step {step}: the update moved the trainer's log-probs of these rollouts by {moved:.2e} nats (mean)")
    for line in failures:
        print(f"FAIL: {line}")
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "vllm_check.json").write_text(json.dumps({"family": family, "dtype": dtype, "precision": precision,
                                                         "steps": rows, "failures": failures}, indent=1))
    print("OK: vLLM engine check passed." if not failures else f"{len(failures)} check(s) failed.")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--family", choices=["llama", "qwen2", "gpt2"], default="llama")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's weights dtype (vllm_dtype)")
    parser.add_argument("--precision", default="bf16-mixed", help="Fabric precision of the update")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (large: a stale engine shows)")
    parser.add_argument("--tolerance", type=float, default=1e-2)
    parser.add_argument("--require-vllm", action="store_true", help="exit 2 instead of 0 without CUDA or vLLM")
    parser.add_argument("--out", type=Path, default=None, help="folder for vllm_check.json")
    args = parser.parse_args(argv)
    return run_check(args.steps, args.family, args.dtype, args.precision, args.lr, args.tolerance, args.require_vllm,
                     out_dir=args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
