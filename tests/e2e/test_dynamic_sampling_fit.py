"""DAPO's dynamic sampling end to end: exact over placements and resume, the probes see every group (docs/grpo.md).

``mrl fit`` runs the tiny two-family config for 4 steps with ``filter_groups: true`` on
llama only (a sparse reward, so a third of its groups have equal rewards and extra
generation batches are drawn), SEE + SGT + a recorder of what ``on_compose_batch`` is
handed: in one process, on two gloo processes colocated (llama's group is both ranks, so
every generation batch of 3 prompts is split 2 / 1 between them, strided over the step's
draw order) and disjoint (one rank per policy). The three
sample the same completions in the same order (SEE's records), log the same scalars and end
with the same weights, up to the float rounding of differently padded shards
(test_dp_exact.py's contract); a run resumed from step 2 equals the straight one bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from test_dp_exact import _scalars, same_completions_and_weights
from test_mwra_fit import DISJOINT, _ckpt, _mrl, _ok

pytestmark = pytest.mark.slow

COLOCATED = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.placement", "colocated"]
CALLBACKS = [{"class_path": "mrl_lightning.callbacks.SharedExperienceExchange",
              "init_args": {"record_types": ["rollout", "group_stats", "success"]}},
             {"class_path": "mrl_lightning.callbacks.SuccessGatedTransfer",
              "init_args": {"lambda_sgt": 0.5, "kappa": 1.0}},
             {"class_path": "e2e_recorder.ComposeRecorder"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from e2e_configs import tiny_config

    folder = tmp_path_factory.mktemp("dynamic_sampling")
    cfg = tiny_config(folder / "cache", folder / "runs", callbacks=CALLBACKS)
    cfg["trainer"].update(max_steps=4, keep_checkpoints=10, num_threads=1)
    cfg["model"]["reward_funcs"] = [{"class_path": "e2e_rewards.SparseHashReward"}]
    cfg["model"]["policies"][1]["init_args"].update(filter_groups=True, max_num_gen_batches=3)
    cfg["data"]["init_args"].update(batch_size=3)  # odd: two ranks hold 2 and 1 prompts of each batch
    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _ok(_mrl(config, "--trainer.version", "one"))
    _ok(_mrl(config, "--trainer.version", "colocated", *COLOCATED))
    _ok(_mrl(config, "--trainer.version", "disjoint", *DISJOINT))
    mid = folder / "runs" / "one" / "checkpoints" / "step=2.ckpt"
    _ok(_mrl(config, "--trainer.version", "resumed", "--ckpt_path", str(mid)))
    return config


def test_extra_generation_batches_were_drawn_and_logged(runs):
    scalars = _scalars(runs.parent / "runs" / "one")
    batches = [v for (tag, _), v in scalars.items() if tag == "rollout/llama/num_gen_batches"]
    assert batches and max(batches) > 1, "no extra generation batch to test"
    assert any(v > 0 for (tag, _), v in scalars.items() if tag == "rollout/llama/filtered_group_share")
    assert not any(tag.startswith("rollout/gpt2/num_gen_batches") for tag, _ in scalars)
    # 4 steps of gpt2's 3 prompts x 4 completions, and llama's 3 prompts per generation batch x 4
    assert _ckpt(runs, "one")["counters"]["samples_seen"] == 4 * 12 + 12 * sum(batches)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_two_ranks_sample_log_and_step_as_one(runs, placement):
    one, two = _ckpt(runs, "one"), _ckpt(runs, placement)
    assert one["counters"] == two["counters"]
    assert one["data"] == two["data"]
    same_completions_and_weights(one, two, placement)
    assert one["callbacks"]["ComposeRecorder"] == two["callbacks"]["ComposeRecorder"]
    a, b = _scalars(runs.parent / "runs" / "one"), _scalars(runs.parent / "runs" / placement)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    differ = [(key, a[key], b[key]) for key in sorted(a)
              if not (a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]))
              and abs(a[key] - b[key]) > 1e-4 * max(1.0, abs(a[key]))]
    assert not differ, differ[:10]


def test_a_resumed_run_equals_the_straight_one_bit_for_bit(runs):
    a, b = _ckpt(runs, "one"), _ckpt(runs, "resumed")
    assert a["counters"] == b["counters"] and a["data"] == b["data"]
    for name in a["policies"]:
        for key, value in a["policies"][name]["model"].items():
            assert torch.equal(value, b["policies"][name]["model"][key]), f"{name}.{key} differs after resume"
    assert a["callbacks"] == b["callbacks"]


def test_the_probes_see_every_group_the_grpo_term_only_the_kept(runs):
    seen = _ckpt(runs, "one")["callbacks"]["ComposeRecorder"]["seen"]
    llama = [row for key, row in seen.items() if key.endswith("/llama")]
    gpt2 = [row for key, row in seen.items() if key.endswith("/gpt2")]
    assert all(row[0] == 3 and row[2] == 3 for row in gpt2)  # no filtering: its 3 groups, all trained on
    assert any(row[0] > 3 for row in llama), "llama drew no extra batch"
    assert all(row[2] <= 3 for row in llama)
    # SGT's rescue set: all-fail groups were handed to the probes although none of them is trained on
    assert sum(row[1] for row in llama) > 0
