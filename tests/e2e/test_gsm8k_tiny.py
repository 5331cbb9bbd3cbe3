"""End to end: ``configs/gsm8k_tiny.yaml`` (GSM8K / MATH samples, train and eval sources apart, chat
templates, math-verify rewards, SGT) trains two tiny local policies of two families for 5 steps through
the CLI on a CPU (the command its header and the README give), from the repository root as a fresh clone
would: no prompt is cut, completions stop at each chat format's end of turn, the console's eval lines
carry values, and a checkpoint and the evaluation tags are written. The run (both warm-starts built in a
fresh cache, then 5 steps) took 102-265 s on 2 shared cores (68 s of CPU): marked slow, it runs in CI's second step
(``pytest -m slow``)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import yaml

from mrl_lightning.run.checkpoint import load_checkpoint
from mrl_lightning.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "gsm8k_tiny.yaml"
GPU_CONFIG = REPO / "configs" / "gsm8k_math_qwen_llama.yaml"


def _parts(path):
    return yaml.safe_load(path.read_text())["data"]["init_args"]["parts"]


def test_config_reads_the_samples_shipped_with_the_repository():
    for part in _parts(CONFIG):
        for source in (part, part["eval_source"]):
            assert (REPO / source["path"]).is_file(), source["path"]
            assert source["path"].startswith("tests/data_samples/")


def test_twin_uses_the_gpu_configs_keys_and_chat_templates():
    def keys(parts):  # config_name is a hub dataset's, unused for the samples' files
        return [(p["name"], sorted(set(p) - {"config_name"}), sorted(set(p["eval_source"]) - {"config_name"}))
                for p in parts]

    assert keys(_parts(CONFIG)) == keys(_parts(GPU_CONFIG))
    for path in (CONFIG, GPU_CONFIG):
        policies = [p["init_args"] for p in yaml.safe_load(path.read_text())["model"]["policies"]]
        assert all(p["chat_template"] and p["system_prompt"] for p in policies)
        assert all(p["prompt_template"] == "{question}" for p in policies)  # no chat format typed by hand
    families = [p["init_args"]["model"]["init_args"]["family"]
                for p in yaml.safe_load(CONFIG.read_text())["model"]["policies"]]
    assert families == ["qwen2", "llama"]  # the GPU config's two families


@pytest.mark.slow
def test_gsm8k_tiny_runs_five_steps_with_no_prompt_cut_and_eval_lines_with_values(tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(REPO)  # the config's data paths are relative to the repository root
    monkeypatch.setenv("MRL_CACHE_DIR", str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the config's own evaluation and checkpoint interval (5): at step 0 and step 5
    rc = main(["fit", "--config", str(CONFIG), "--trainer.max_steps", "5",
                   "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false",
                   "--trainer.num_threads", "1"])
    assert rc == 0
    assert not [w for w in caught if "max_prompt_length" in str(w.message)], "a prompt was cut"
    out = capsys.readouterr().out
    evals = [line for line in out.splitlines() if line.startswith("[eval] step")]
    assert [line.split(":")[0] for line in evals] == ["[eval] step 0", "[eval] step 5"]
    for line in evals:  # qwen2 is strong at gsm8k, llama at math: both show their values
        assert re.fullmatch(r"\[eval\] step \d: qwen2 strong \d\.\d\d weak \d\.\d\d \(greedy \d\.\d\d\) \| "
                            r"llama strong \d\.\d\d weak \d\.\d\d \(greedy \d\.\d\d\)", line), line

    (run,) = [p.parent for p in (tmp_path / "runs").glob("*/config.yaml")]
    saved = (run / "config.yaml").read_text()
    assert "MathVerifyReward" in saved and "MathDataModule" in saved and "max_steps: 5" in saved

    state = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert state["counters"]["global_step"] == 5
    assert set(state["policies"]) == {"qwen2", "llama"}

    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for policy in ("qwen2", "llama"):
        for part in ("gsm8k", "math"):
            for tag in (f"eval/{policy}/greedy_success_{part}", f"eval/{policy}/success_{part}",
                        f"eval/{policy}/mean_at_k_{part}", f"eval/{policy}/pass_at_k_{part}"):
                assert tag in tags, f"missing {tag}"
                assert [s.step for s in events.Scalars(tag)] == [0, 5]  # at the start and the end
        assert f"rollout/{policy}/reward_mean" in tags
        # math-verify scored every completion: no reference failed to parse, no check timed out
        assert [s.value for s in events.Scalars(f"rollout/{policy}/nan_reward_share")] == [0.0] * 5
        assert [s.value for s in events.Scalars(f"rollout/{policy}/prompts_truncated_share")] == [0.0] * 5
        # the warm-start taught each model its end of turn: some completions stop there (finish 'stop')
        assert min(s.value for s in events.Scalars(f"rollout/{policy}/truncated_share")) < 1.0
