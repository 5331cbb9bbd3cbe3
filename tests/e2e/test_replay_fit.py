"""``mrl replay`` end to end (docs/see.md, "Replay"): one policy of a two-worker run trained again in one process,
its peer's records read from the run's exchange log, ends with the run's weights, optimizer state and log.

Real runs of the tiny two-family config (SGT on SEE, every record type logged). The replays run without
``OMP_NUM_THREADS``, so Lightning's launcher would set torch's threads to cores / processes: the loop sets
``trainer.num_threads`` after it (a replay with two threads would not be equal).
"""

from __future__ import annotations

import pytest
import yaml
from test_mwra_fit import DISJOINT, _ckpt, _mrl, _ok, write_stepwise_config
from test_pace_fit import _equal


def _logged_config(folder, max_steps: int):
    config = write_stepwise_config(folder, max_steps=max_steps)
    cfg = yaml.safe_load(config.read_text())
    cfg["trainer"]["callbacks"][0]["init_args"]["log_path"] = "exchange.jsonl"
    config.write_text(yaml.safe_dump(cfg))
    return config


def _replay(config, run: str, version: str, policy: str, *extra: str):
    saved = config.parent / "runs" / run / "config.yaml"  # the run's own config: devices 2, disjoint
    return _mrl(saved, "--exchange_log", str(config.parent / "runs" / run / "exchange.jsonl"), "--policies", policy,
                "--trainer.version", version, *extra, command="replay", omp_num_threads=None)


def _assert_replayed(config, run: str, version: str, policy: str, other: str) -> None:
    a, b = _ckpt(config, run), _ckpt(config, version)
    assert set(b["policies"]) == {policy}, "a replay checkpoints the policies it trained"
    for part in ("model", "optimizer"):
        assert _equal(a["policies"][policy][part], b["policies"][policy][part]), f"{policy} {part} differs"
    assert a["counters"] == b["counters"] and a["data"] == b["data"]
    assert a["callbacks"]["SharedExperienceExchange"] == b["callbacks"]["SharedExperienceExchange"]
    runs = config.parent / "runs"
    log = (runs / run / "exchange.jsonl").read_bytes()
    assert log.count(b"\n") > 40 and (runs / version / "exchange.jsonl").read_bytes() == log


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    config = _logged_config(tmp_path_factory.mktemp("replay"), max_steps=4)
    _ok(_mrl(config, "--trainer.version", "run"))  # one process (two workers replay equal too: the slow test below)
    return config


def test_a_replayed_policy_ends_equal_to_the_run(logged):
    proc = _replay(logged, "run", "gpt2", "gpt2")
    _ok(proc)
    assert "Replayed against" in proc.stdout and "of 'llama'" in proc.stdout
    _assert_replayed(logged, "run", "gpt2", "gpt2", "llama")
    saved = (logged.parent / "runs" / "gpt2" / "config.yaml").read_text()
    assert "exchange_log" not in saved and "verify" not in saved  # mrl fit reads it
    proc = _mrl(logged.parent / "runs" / "gpt2" / "config.yaml", "--trainer.version", "fit-on", "--trainer.max_steps", "6",
                "--ckpt_path", str(logged.parent / "runs" / "gpt2" / "checkpoints" / "last.ckpt"))
    assert proc.returncode == 2 and "it is a replay's: resume it with mrl replay --policies ['gpt2']" in proc.stderr


@pytest.mark.slow
def test_a_two_worker_run_replays_equal_in_one_process_and_its_peer_records_matter(tmp_path):
    """Without ``OMP_NUM_THREADS`` the replay's one process under the run's ``strategy: ddp`` got cores / processes
    threads from Lightning's launcher before the loop set ``num_threads`` after it: not equal then."""
    config = _logged_config(tmp_path, max_steps=4)
    _ok(_mrl(config, "--trainer.version", "run", *DISJOINT))
    proc = _replay(config, "run", "gpt2", "gpt2")
    _ok(proc)
    assert "mrl replay runs in one process" in proc.stderr and "the config gave devices 2" in proc.stderr
    _assert_replayed(config, "run", "gpt2", "gpt2", "llama")
    # the peer's records are read, not ignored: without llama's successes (what SGT transfers) gpt2 trains otherwise
    runs = config.parent / "runs"
    (runs / "cut").mkdir()
    lines = (runs / "run" / "exchange.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if not ('"source": "llama"' in line and '"record_type": "success"' in line)]
    assert len(kept) < len(lines)
    (runs / "cut" / "exchange.jsonl").write_text("".join(kept))
    (runs / "cut" / "config.yaml").write_text((runs / "run" / "config.yaml").read_text())
    proc = _replay(config, "cut", "cut-checked", "gpt2")  # gpt2's own batches then differ from the log's: refused
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "of 'gpt2' differs from the run's log" in proc.stderr and "--verify false" in proc.stderr
    _ok(_replay(config, "cut", "cut-replay", "gpt2", "--verify", "false"))  # a counterfactual replay
    cut, run = _ckpt(config, "cut-replay")["policies"]["gpt2"]["model"], _ckpt(config, "run")["policies"]["gpt2"]["model"]
    assert any(not cut[k].equal(run[k]) for k in run), "gpt2 trained the same without llama's successes"


def test_a_bad_replay_is_refused_before_any_model_is_built(logged):
    proc = _replay(logged, "run", "bad", "mistral")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--policies names 'mistral', which is not in model.policies ['gpt2', 'llama']" in proc.stderr
    assert "Resource plan" not in proc.stdout  # (the other refusals: tests/loop/test_replay.py)


@pytest.mark.slow
def test_a_lagged_run_replays_equal_and_a_replay_resumes_exactly(tmp_path):
    config = _logged_config(tmp_path, max_steps=5)
    _ok(_mrl(config, "--trainer.version", "lag", "--trainer.max_lag", "2", *DISJOINT))
    _ok(_replay(config, "lag", "llama", "llama"))
    _assert_replayed(config, "lag", "llama", "llama", "gpt2")
    # a replay resumes from its own checkpoint (batches in flight, the logged policy's records among them),
    # and from the run's
    for version, source in (("own", "llama"), ("run", "lag")):
        mid = config.parent / "runs" / source / "checkpoints" / "step=2.ckpt"
        _ok(_replay(config, "lag", f"resumed-{version}", "llama", "--ckpt_path", str(mid)))
        a, b = _ckpt(config, "lag"), _ckpt(config, f"resumed-{version}")
        assert _equal(a["policies"]["llama"]["model"], b["policies"]["llama"]["model"]), version
