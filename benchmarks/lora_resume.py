"""LoRA on the default: 100 steps straight; the same run SIGKILLed after its step-60 checkpoint, resumed, compared exactly; export. Not a test.

    python benchmarks/lora_resume.py   # from the repository root, writes runs/lora_resume
"""
import os, signal, subprocess, sys, time, json
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mrl_lightning.run.checkpoint import load_checkpoint

M = Path(__file__).resolve().parents[1]; OUT = M / "runs" / "lora_resume"; OUT.mkdir(parents=True, exist_ok=True)
MRL = str(M / ".venv/bin/mrl")
base = ["fit", "--config", str(M / "configs/default.yaml"), "--config", str(M / "configs/lora.yaml"),
        "--trainer.max_steps", "100", "--trainer.checkpoint_every_n_steps", "20", "--trainer.eval_every_n_steps", "50",
        "--trainer.log_every_n_steps", "1", "--trainer.keep_checkpoints", "10", "--trainer.default_root_dir", str(OUT)]
t0 = time.time()
subprocess.run([MRL, *base, "--trainer.version", "straight"], check=True, stdout=open(OUT / "straight.log", "w"), stderr=subprocess.STDOUT)
print(f"straight run {time.time() - t0:.0f} s")
log = open(OUT / "killed.log", "w")
p = subprocess.Popen([MRL, *base, "--trainer.version", "killed"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
ck = OUT / "killed" / "checkpoints"
while not (ck / "step=60.ckpt").exists():
    time.sleep(0.2)
time.sleep(3.0)  # mid-way between checkpoints
os.killpg(p.pid, signal.SIGKILL); p.wait()
time.sleep(1)
left = subprocess.run(["pgrep", "-f", "version killed"], capture_output=True, text=True).stdout.split()
print("killed after step=60.ckpt; left processes:", left)
newest = max(ck.glob("step=*.ckpt"), key=lambda q: int(q.stem.split("=")[1]))
print("resume from", newest.name)
subprocess.run([MRL, *base, "--trainer.version", "resumed", "--ckpt_path", str(newest)], check=True,
               stdout=open(OUT / "resumed.log", "w"), stderr=subprocess.STDOUT)
a = load_checkpoint(OUT / "straight/checkpoints/last.ckpt"); b = load_checkpoint(OUT / "resumed/checkpoints/last.ckpt")
assert a["counters"] == b["counters"], (a["counters"], b["counters"])
n = 0
for name in a["policies"]:
    keys = list(a["policies"][name]["model"])
    assert all("lora_" in k or "modules_to_save" in k for k in keys), [k for k in keys if "lora_" not in k][:5]
    for k, v in a["policies"][name]["model"].items():
        assert torch.equal(v, b["policies"][name]["model"][k]), k; n += 1
    for k, st in a["policies"][name]["optimizer"]["state"].items():
        for kk, vv in st.items():
            assert torch.equal(vv, b["policies"][name]["optimizer"]["state"][k][kk]) if torch.is_tensor(vv) else vv == b["policies"][name]["optimizer"]["state"][k][kk]
print(f"resumed == straight exactly: {n} adapter tensors + AdamW state; checkpoint keys are adapter-only")
size = (OUT / "straight/checkpoints/last.ckpt").stat().st_size
print(f"last.ckpt {size/1e6:.2f} MB")
subprocess.run([MRL, "export", "--run", str(OUT / "straight"), "--policy", "gpt2", "--out", str(OUT / "exported_gpt2")], check=True)
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(OUT / "exported_gpt2")
print("exported gpt2 loads with from_pretrained:", type(m).__name__, sum(p.numel() for p in m.parameters()))
