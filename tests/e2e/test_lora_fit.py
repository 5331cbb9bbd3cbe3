"""LoRA policies end to end: ``mrl fit`` trains adapters only, resumes exactly, ``mrl export`` merges them."""

from __future__ import annotations

import pytest
import torch

from mrl_lightning.run.checkpoint import load_checkpoint
from mrl_lightning.cli import main

pytest.importorskip("peft")


def _lora(cfg) -> None:
    gpt2, llama = (p["init_args"] for p in cfg["model"]["policies"])
    gpt2.update(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["c_attn", "c_fc"], beta=0.05)
    llama.update(use_peft=True, lora_r=4, lora_alpha=8, gradient_checkpointing=True, share_prompt_forward=False)
    cfg["trainer"].update(max_steps=4, keep_checkpoints=10)


def test_a_lora_run_checkpoints_adapters_only_resumes_exactly_and_exports_a_merged_model(write_config, tmp_path,
                                                                                           capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    straight = write_config("straight.yaml", modify=lambda c: (_lora(c), c["trainer"].update(version="straight")))
    assert main(["fit", "--config", str(straight)]) == 0
    plan = capsys.readouterr().out
    assert "LoRA r=4" in plan and "grad. ckpt" in plan  # the plan says what is on
    run = straight.parent / "runs" / "straight"
    last = load_checkpoint(run / "checkpoints" / "last.ckpt")
    for name, part in last["policies"].items():
        assert part["model"] and all("lora_" in key for key in part["model"]), name
        moments = [s["exp_avg"].numel() for s in part["optimizer"]["state"].values()]
        assert sum(moments) == sum(v.numel() for v in part["model"].values()), name  # adapter moments only
    first = load_checkpoint(run / "checkpoints" / "step=1.ckpt")
    assert any(not torch.equal(first["policies"]["gpt2"]["model"][k], v)
               for k, v in last["policies"]["gpt2"]["model"].items()), "the adapter did not train"

    resumed = write_config("resumed.yaml", modify=lambda c: (_lora(c), c["trainer"].update(version="resumed")))
    assert main(["fit", "--config", str(resumed), "--ckpt_path", str(run / "checkpoints" / "step=2.ckpt")]) == 0
    again = load_checkpoint(resumed.parent / "runs" / "resumed" / "checkpoints" / "last.ckpt")
    for name in last["policies"]:
        for key, value in last["policies"][name]["model"].items():
            assert torch.equal(again["policies"][name]["model"][key], value), f"{name}.{key} after resume"

    out = tmp_path / "exported_gpt2"
    assert main(["export", "--run", str(run), "--policy", "gpt2", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    assert not any("lora" in n for n, _ in model.named_parameters())
    from mrl_lightning.builders import build_policy
    from mrl_lightning.commands.export import build_only

    cli = build_only(run / "config.yaml")
    policy = cli.model.policies["gpt2"]
    cli.datamodule.setup("fit")
    build_policy(policy, cli.datamodule)
    policy.load_weights_state_dict(last["policies"]["gpt2"]["model"])
    ids = torch.tensor([tok("Calculate 3 + 4.\nAnswer:")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, policy.model.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    assert main(["export", "--run", str(run), "--policy", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "'nope' is not a policy of this run" in capsys.readouterr().err
