"""GPU check of chat stops on every engine and of the three families (part of ``scripts/gpu_check.sh``).

    python scripts/gpu_check_chat.py [--out DIR] [--steps 5] [--dry-run-on-cpu]

Installs and downloads nothing. Two checks, each printed with its numbers; exit code 1 when
one fails (docs/rollout.md, "Stops" and "Checking on a GPU"):

1. Chat stops. The tiny chat model of ``tests/rollout/tiny_models.py`` (GPT-2, width 64,
   Phi-3-style roles; its turn ends with ``<|end|>``, which only the chat template knows:
   ``generation_config.json`` lists EOS alone) samples 2 prompts x 6 completions of at most
   10 tokens through its chat template on each engine: ``hf``; ``vllm`` colocated where vLLM
   is importable; ``vllm`` server where ``trl`` is importable too and there are two GPUs
   (``trl vllm-serve`` is started here on GPU 1: NCCL cannot join two processes on one GPU).
   Passes when some completion ends at ``<|end|>`` with finish ``stop``, no completion holds
   a stop id before its last token, every ``length`` completion is 10 tokens long, and, with
   EOS as the only stop id, some completion runs on past ``<|end|>`` (so the check can fail).
2. Three families. ``mrl fit --config configs/three_families.yaml`` (Qwen2, Mistral with its
   real v3 tokenizer, Phi-3) for ``--steps`` steps with warm-starts cut to 50 steps (the check
   is of the path, not of learning), on the ``hf`` engine and, where vLLM is importable, with
   ``rollout_engine: vllm`` on all three. Passes when the run ends, its eval line names the
   three policies and, under vLLM, the first update's importance ratio is within 1e-2 of 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "rollout"))
sys.path.insert(0, str(REPO / "benchmarks"))

QUESTIONS = ("12 + 34?", "7 - 5?")
G, L = 6, 10


def stop_failures(name: str, rows: list[list[int]], reasons: list[str], end: int, eos: int) -> list[str]:
    """Problems of one engine's completions (ids through the mask) under the policy's stop ids."""
    out = []
    for ids, reason in zip(rows, reasons):
        if any(t in (end, eos) for t in ids[:-1]):
            out.append(f"{name}: a stop id before the last token: {ids} ({reason})")
        if reason == "stop" and ids[-1] not in (end, eos):
            out.append(f"{name}: finish 'stop' but the last token {ids[-1]} is no stop id")
        if reason == "length" and (len(ids) != L or ids[-1] in (end, eos)):
            out.append(f"{name}: finish 'length' on {len(ids)} tokens ending {ids[-1:]}")
    if not any(r == "stop" and ids[-1] == end for ids, r in zip(rows, reasons)):
        out.append(f"{name}: no completion ended at <|end|> with finish 'stop' ({reasons})")
    return out


def check_stops(engine_name: str, folder: Path, device: str, factory=None, server_port: int | None = None,
                device_memory_gib: float | None = None) -> list[str]:
    """Sample the chat model on one engine (``hf``, ``vllm``, ``vllm_server``); return the failures.

    ``factory``, ``device_memory_gib``: a vLLM double's factory and a device size
    (``build_vllm_engine``'s), for a CPU test of this check.
    """
    from mrl_lightning.builders import build_policy, build_vllm_engine
    from mrl_lightning.policy import PolicyModule
    from mrl_lightning.rollout import HFGenerateEngine

    vllm = engine_name.startswith("vllm")
    policy = PolicyModule(name="chat", model=str(folder), chat_template=True, temperature=1.0, num_generations=G,
                          max_completion_length=L, rollout_engine="vllm" if vllm else "hf",
                          vllm_mode="server" if engine_name == "vllm_server" else "colocate", vllm_dtype="float32",
                          vllm_server_port=server_port or 8000, vllm_server_timeout=300.0)
    build_policy(policy)
    policy.model.to(device)
    engine = build_vllm_engine(policy, [policy], len(QUESTIONS), factory=factory,
                                device_memory_gib=device_memory_gib) if vllm else HFGenerateEngine()
    prompts = policy.encode_prompts([policy.render_prompt(SimpleNamespace(question=q)) for q in QUESTIONS])
    end, eos = policy.end_of_turn_id, policy.tokenizer.eos_token_id

    def sample(stops):
        out = engine.generate(policy.model, policy.tokenizer, prompts, num_generations=G, max_completion_length=L,
                              temperature=1.0, prompt_seeds=[1, 11], stop_token_ids=stops)
        rows = [out.completion_ids[r][out.completion_mask[r]].tolist() for r in range(out.completion_ids.shape[0])]
        return rows, out.finish_reasons

    start = time.perf_counter()
    rows, reasons = sample(policy.stop_token_ids)
    failures = stop_failures(engine_name, rows, reasons, end, eos)
    eos_rows, _ = sample([eos])
    ran_on = sum(1 for ids in eos_rows if end in ids[:-1])
    at_end = sum(1 for ids, r in zip(rows, reasons) if r == "stop" and ids[-1] == end)
    print(f"  {engine_name:12s} {at_end}/{len(rows)} ended at <|end|> (finish 'stop'); EOS as the only stop id: "
          f"{ran_on} ran on past it; {time.perf_counter() - start:.1f} s", flush=True)
    if not ran_on:
        failures.append(f"{engine_name}: with EOS as the only stop id no completion ran past <|end|>: this model "
                        "cannot tell an engine that ignores the end of turn from one that stops there")
    return failures


def _start_server(folder: Path, port: int, log: Path) -> subprocess.Popen:
    trl = Path(sys.executable).parent / "trl"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    args = [str(trl), "vllm-serve", "--model", str(folder), "--port", str(port), "--gpu_memory_utilization", "0.3",
            "--max_model_len", "256", "--enforce_eager", "true"]
    print(f"  starting: CUDA_VISIBLE_DEVICES=1 {' '.join(args)} (log {log})", flush=True)
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def three_families(out: Path, steps: int, accelerator: str, precision: str, engine: str) -> list[str]:
    """``mrl fit`` of configs/three_families.yaml with short warm-starts on ``engine``; return the failures."""
    import yaml
    from mwra import read  # benchmarks/mwra.py

    cfg = yaml.safe_load((REPO / "configs" / "three_families.yaml").read_text())
    name = f"three_families_{engine}"
    cfg["trainer"].update(max_steps=steps, accelerator=accelerator, precision=precision, log_every_n_steps=1,
                          eval_every_n_steps=steps, checkpoint_every_n_steps=0, enable_progress_bar=False,
                          default_root_dir=str(out / name), version="run")
    for p in cfg["model"]["policies"]:
        p["init_args"]["model"]["init_args"].update(warm_start_steps=50, cache_dir=str(out / "cache"))
        if engine == "vllm":
            p["init_args"].update(rollout_engine="vllm", vllm_dtype="float32")
    config = out / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "mrl_lightning.cli", "fit", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    text = (out / f"{name}.log").read_text()
    evals = [line for line in text.splitlines() if line.startswith("[eval] step")]
    print(f"  {name}: exit {code}, {time.perf_counter() - start:.0f} s; {evals[-1] if evals else 'no eval line'}")
    if code != 0:
        return [f"{name}: mrl fit exited with {code}; see {out / f'{name}.log'}"]
    failures = [f"{name}: the eval line does not name {p}" for p in ("qwen2", "mistral", "phi3")
                if not evals or p not in evals[-1]]
    if engine == "vllm":
        scalars = read(out / name / "run")
        for p in ("qwen2", "mistral", "phi3"):
            ratio = scalars[f"rollout/{p}/is_ratio_mean"][0][2]
            if abs(ratio - 1.0) > 1e-2:
                failures.append(f"{name}/{p}: first importance ratio {ratio:.4f}, more than 1e-2 from 1")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check" / "chat")
    parser.add_argument("--server-port", type=int, default=8011)
    parser.add_argument("--dry-run-on-cpu", action="store_true", help="the same checks on the CPU (vLLM's CPU build "
                        "if installed; no server), to check the script itself")
    args = parser.parse_args(argv)
    import torch

    from tiny_models import build_tiny_chat_gpt2

    if not args.dry_run_on_cpu and not torch.cuda.is_available():
        print("no CUDA device is visible: this check needs a GPU (or --dry-run-on-cpu).")
        return 2
    device, precision = ("cpu", "32-true") if args.dry_run_on_cpu else ("cuda", "bf16-mixed")
    gpus = 0 if args.dry_run_on_cpu else torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = build_tiny_chat_gpt2(Path(tempfile.mkdtemp(prefix="chat_", dir=args.out)), width=64, end_boost=14.0,
                                  end_in_generation_config=False)
    has_vllm = importlib.util.find_spec("vllm") is not None
    engines = ["hf"] + (["vllm"] if has_vllm else [])
    print(f"\n== chat stops ({device}): engines {engines}", flush=True)
    failures: list[str] = []
    for name in engines:
        failures += check_stops(name, folder, device)
    server = None
    if has_vllm and importlib.util.find_spec("trl") is not None and gpus >= 2:
        server = _start_server(folder, args.server_port, args.out / "vllm_serve.log")
        try:
            failures += check_stops("vllm_server", folder, device, server_port=args.server_port)
        except Exception as err:  # noqa: BLE001  (a server that did not start is a failed check, reported)
            failures.append(f"vllm_server: {type(err).__name__}: {err} (server log {args.out / 'vllm_serve.log'})")
        finally:
            server.terminate()
    else:
        print("  vllm_server  skipped: needs vllm and trl importable and two GPUs (server on GPU 1)")
    print(f"\n== three families ({device}): configs/three_families.yaml, {args.steps} steps", flush=True)
    for engine in engines:
        if engine == "vllm" and args.dry_run_on_cpu:  # the Mistral policy's heads are 16 wide: too narrow for it
            print("  three_families_vllm skipped on the CPU: vLLM's CPU build takes head sizes from 32 up")
            continue
        failures += three_families(args.out, args.steps, device, precision, engine)
    print("\n" + ("\n".join(f"FAIL {f}" for f in failures) if failures else "chat stop and three-family checks passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
