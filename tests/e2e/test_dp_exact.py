"""Data parallelism that means what it says: a policy on a group of 2 ranks logs and steps as 1 rank (docs/mwra.md).

For every probe (none, SGT with its gradient-share bound, PRP, XGRPO), ``mrl fit`` runs the
tiny two-family config for 4 steps twice, one thread per process: in one process, and on
two gloo processes with both policies colocated (each policy's group is both ranks, so
every step's prompts are split between them). Exact in the contract's sense: the same
completions (SEE's records: texts and rewards), every logged scalar that is not a time
(rewards, stds, transfers, grad shares, clip ratios, THL residuals, PRP weights, ...) and the
weights, up to the float rounding of the forward passes on differently padded shards.
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_mwra_fit import _ckpt, _mrl, _ok

pytestmark = pytest.mark.slow

TWO_RANKS = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "colocated"]
TIMING = re.compile(r"(_time_s$|/rollout_s$|/update_s$|/wait(_[a-z]+)?_s$|/idle_share$|/elapsed_s$|tokens_per_s$|"
                    r"peak_memory|step_time_s$)")
SEE = {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange",
       "init_args": {"record_types": ["rollout", "group_stats", "success"]}}
PROBES = {
    "none": [SEE, {"class_path": "mrl_lightning.callbacks.NoSharing"}],
    "sgt": [SEE, {"class_path": "mrl_lightning.callbacks.SuccessGatedTransfer",
                  "init_args": {"lambda_sgt": 0.5, "kappa": 1.0, "max_grad_share": 0.3}}],
    "prp": [SEE, {"class_path": "mrl_lightning.callbacks.PeerRolloutPooling",
                  "init_args": {"max_peers_per_prompt": 2, "is_mode": "clip", "c": 2.0}}],
    "xgrpo": [SEE, {"class_path": "mrl_lightning.callbacks.CrossPolicyAdvantage", "init_args": {"alpha": 0.5}}],
}


def _scalars(run_dir) -> dict[tuple[str, int], float]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {(tag, e.step): e.value for tag in events.Tags()["scalars"] if not TIMING.search(tag)
            for e in events.Scalars(tag)}


def same_completions_and_weights(one: dict, two: dict, what: str) -> None:
    """Two runs' checkpoints hold the same completions (SEE's records, in order) and weights within 1e-4."""
    records = [one["callbacks"]["SharedExperienceExchange"]["exchange"]["records"],
               two["callbacks"]["SharedExperienceExchange"]["exchange"]["records"]]
    texts = [[(rec.get("completion_text"), rec.get("reward")) for _, rec in rs] for rs in records]  # [seq, record]
    assert any(text for text, _ in texts[0]), "no completion in the exchange to compare"
    assert texts[0] == texts[1], f"{what}: the completions (or their order in SEE) differ"
    # AdamW moves a weight by up to lr = 1e-2 a step whatever the gradient's size, so the
    # float rounding of two ranks' forward passes can show up to a small fraction of one step
    # (1.6e-5 measured after 4 steps); 1e-4 is 1% of one step and far below any real change.
    for name in one["policies"]:
        for key, value in one["policies"][name]["model"].items():
            torch.testing.assert_close(two["policies"][name]["model"][key], value, rtol=0, atol=1e-4,
                                       msg=lambda m, name=name, key=key: f"{what}: {name}.{key}: {m}")


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_two_rank_group_logs_and_steps_as_one_rank(tmp_path, probe):
    from e2e_configs import tiny_config

    cfg = tiny_config(tmp_path / "cache", tmp_path / "runs", callbacks=PROBES[probe])
    cfg["trainer"].update(max_steps=4, num_threads=1, checkpoint_every_n_steps=0)
    cfg["data"]["init_args"].update(batch_size=4)  # two prompts per rank, one of each part
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _ok(_mrl(config, "--trainer.version", "one"))
    _ok(_mrl(config, "--trainer.version", "two", *TWO_RANKS))

    one, two = _ckpt(config, "one"), _ckpt(config, "two")
    assert two["placement"]["groups"] == {"gpt2": [0, 1], "llama": [0, 1]}
    same_completions_and_weights(one, two, probe)
    a, b = _scalars(config.parent / "runs" / "one"), _scalars(config.parent / "runs" / "two")
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    if probe == "sgt":
        assert any(tag.endswith("/transfers") and v > 0 for (tag, _), v in a.items()), "no transfer to compare"
        assert any(tag.endswith("/grad_share") and v > 0 for (tag, _), v in a.items())
    if probe == "prp":
        assert any(tag.endswith("/peers_pooled") and v > 0 for (tag, _), v in a.items())
    differ = [(key, a[key], b[key]) for key in sorted(a)
              if not (a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]))
              and abs(a[key] - b[key]) > 1e-4 * max(1.0, abs(a[key]))]
    assert not differ, differ[:10]


PLACEMENTS = {"one": ["--trainer.devices", "1"],
              "colocated": ["--trainer.devices", "2", "--trainer.placement", "colocated"],
              "disjoint": ["--trainer.devices", "2", "--trainer.placement", "disjoint"]}


def test_the_default_with_sgt_logs_and_steps_alike_on_one_rank_and_on_two(tmp_path):
    """configs/default.yaml (SGT with its bound, the shipped warm-started models) for 20 steps in one process,
    on a colocated group of 2 ranks (both policies on both) and disjoint (one rank each): every logged scalar
    that is not a time or a memory reading, at every step and evaluation, within float rounding; the same
    sample completions; the same weights (docs/mwra.md, docs/probes.md "Bound")."""
    from test_mwra_fit import REPO

    cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    cfg["trainer"].update(max_steps=20, eval_every_n_steps=10, log_every_n_steps=1, checkpoint_every_n_steps=0,
                          default_root_dir=str(tmp_path / "runs"))
    for policy in cfg["model"]["policies"]:
        recipe = policy["init_args"]["model"]["init_args"]
        recipe["prebuilt"] = str(REPO / recipe["prebuilt"])
        recipe["cache_dir"] = str(tmp_path / "cache")
    config = tmp_path / "default.yaml"
    config.write_text(yaml.safe_dump(cfg))
    for version, args in PLACEMENTS.items():
        _ok(_mrl(config, "--trainer.version", version, *args, timeout=600))
    runs = {version: _scalars(tmp_path / "runs" / version) for version in PLACEMENTS}
    texts = {version: _texts(tmp_path / "runs" / version) for version in PLACEMENTS}
    one = runs["one"]
    assert any(tag.endswith("/transfers") and v > 0 for (tag, _), v in one.items()), "no transfer to compare"
    shares = [v for (tag, _), v in one.items() if tag.endswith("/grad_share_max")]
    bounds = [v for (tag, _), v in one.items() if tag.endswith("/grad_share_bound")]
    assert shares and max(shares) <= max(bounds) + 1e-6
    for version in ("colocated", "disjoint"):
        other = runs[version]
        assert set(one) == set(other), (version, sorted(set(one) ^ set(other))[:10])
        differ = [(key, one[key], other[key]) for key in sorted(one)
                  if not (one[key] == other[key] or (one[key] != one[key] and other[key] != other[key]))
                  and abs(one[key] - other[key]) > 1e-4 * max(1.0, abs(one[key]))]
        assert not differ, (version, differ[:10])
        assert texts[version] == texts["one"], version
        same_completions_and_weights(_ckpt(config, "one"), _ckpt(config, version), version)


def _texts(run_dir) -> dict[tuple[str, int], bytes]:
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    return {(tag, e.step): bytes(e.tensor_proto.string_val[0]) for tag in events.Tags().get("tensors", [])
            for e in events.Tensors(tag)}
