"""FSDP through ``mrl fit`` (docs/mwra.md "FSDP inside a policy's group"): a sharded policy trains as an unsharded one.

The tiny two-family config with SGT runs 4 steps, one thread per process: once in one
process, and once on two gloo processes with both policies colocated and sharded over both
ranks (``fsdp: true``; 2 cores here, and a CPU run refuses more workers than cores). The same completions (SEE's records), every logged
scalar that is not a time and the weights (the checkpoint holds full tensors) agree up to
float reduction order. Then the sharded run resumed from its step-2 checkpoint ends where the
uninterrupted one did, exactly.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from test_dp_exact import PROBES, _scalars, same_completions_and_weights
from test_mwra_fit import _ckpt, _mrl, _ok

pytestmark = pytest.mark.slow

SHARDED = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "colocated"]


def test_a_sharded_policy_trains_as_the_unsharded_one_and_resumes_exactly(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    from e2e_configs import tiny_config

    cfg = tiny_config(tmp_path / "cache", tmp_path / "runs", callbacks=PROBES["sgt"])
    cfg["trainer"].update(max_steps=4, num_threads=1, checkpoint_every_n_steps=2, keep_checkpoints=5)
    cfg["data"]["init_args"].update(batch_size=4)  # two prompts per rank of gpt2's group
    plain = tmp_path / "tiny.yaml"
    plain.write_text(yaml.safe_dump(cfg))
    for policy in cfg["model"]["policies"]:
        policy["init_args"]["fsdp"] = True
    sharded = tmp_path / "sharded.yaml"
    sharded.write_text(yaml.safe_dump(cfg))

    _ok(_mrl(plain, "--trainer.version", "one", timeout=400))
    _ok(_mrl(sharded, "--trainer.version", "fsdp", *SHARDED, timeout=400))
    one, two = _ckpt(plain, "one"), _ckpt(sharded, "fsdp")
    assert two["placement"]["groups"] == {"gpt2": [0, 1], "llama": [0, 1]}
    same_completions_and_weights(one, two, "sharded")
    a, b = _scalars(tmp_path / "runs" / "one"), _scalars(tmp_path / "runs" / "fsdp")
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    assert any(tag == "probe/sgt/gpt2/grad_share" and v > 0 for (tag, _), v in a.items()), "no transfer to compare"
    differ = [(key, a[key], b[key]) for key in sorted(a)
              if not (a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]))
              and abs(a[key] - b[key]) > 1e-4 * max(1.0, abs(a[key]))]
    assert not differ, differ[:10]

    # resumed from step 2 (full tensors in the checkpoint, sharded again on load): the same step 4, exactly
    middle = tmp_path / "runs" / "fsdp" / "checkpoints" / "step=2.ckpt"
    assert middle.exists(), sorted(p.name for p in middle.parent.iterdir())
    _ok(_mrl(sharded, "--trainer.version", "resumed", "--ckpt_path", str(middle), *SHARDED, timeout=400))
    again = _ckpt(sharded, "resumed")
    assert again["counters"] == two["counters"]
    for name in two["policies"]:
        for key, value in two["policies"][name]["model"].items():
            torch.testing.assert_close(again["policies"][name]["model"][key], value, rtol=0, atol=0,
                                       msg=f"resume: {name}.{key}")
        for key, value in two["policies"][name]["optimizer"]["state"].items():
            for k, v in value.items():
                torch.testing.assert_close(again["policies"][name]["optimizer"]["state"][key][k], v, rtol=0, atol=0,
                                           msg=f"resume optimizer: {name}.{key}.{k}")
