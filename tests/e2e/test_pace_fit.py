"""``trainer.max_lag`` end to end: a lagged run on one process equals two workers and resumes exactly (docs/mwra.md,
"Pace"). Real ``mrl fit`` runs of the tiny two-family config (SGT on SEE), one thread per worker."""

from __future__ import annotations

import pytest
from test_mwra_fit import DISJOINT, _assert_same_run, _ckpt, _mrl, _ok, write_stepwise_config

LAG = ["--trainer.max_lag", "2"]


def _equal(a, b) -> bool:
    """Nested dicts / lists of tensors and plain values, equal exactly."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    if hasattr(a, "equal"):
        return hasattr(b, "equal") and a.dtype == b.dtype and a.equal(b)
    return a == b


def _assert_same_lagged_run(a: dict, b: dict, what: str) -> None:
    assert _equal(a["counters"].pop("in_flight"), b["counters"].pop("in_flight")), f"{what}: batches in flight differ"
    _assert_same_run(a, b, what)


@pytest.fixture(scope="module")
def lagged(tmp_path_factory):
    config = write_stepwise_config(tmp_path_factory.mktemp("pace"), max_steps=5)
    _ok(_mrl(config, "--trainer.version", "one", *LAG))
    _ok(_mrl(config, "--trainer.version", "two", *LAG, *DISJOINT))
    _ok(_mrl(config, "--trainer.version", "lockstep"))
    return config


def test_one_process_equals_two_workers_and_differs_from_lockstep(lagged):
    for step in (2, 3, 5):
        name = f"step={step}.ckpt" if step < 5 else "last.ckpt"
        _assert_same_lagged_run(_ckpt(lagged, "one", name), _ckpt(lagged, "two", name), f"step {step}")
    two, lockstep = _ckpt(lagged, "two"), _ckpt(lagged, "lockstep")
    # the lag is real: batches 3-4 were in flight at step 2 (sampled, kept with their records), and
    # the final weights are not lockstep's
    mid = _ckpt(lagged, "two", "step=2.ckpt")["counters"]
    assert mid["rollout_step"] == 4 and sorted(mid["in_flight"]) == [3, 4] and sorted(mid["exchange_pending"]) == [3, 4]
    assert set(mid["in_flight"][3]) == {"gpt2/0of1", "llama/0of1"}
    assert two["counters"]["global_step"] == lockstep["counters"]["global_step"] == 5
    assert two["counters"]["in_flight"] == {}
    differs = [key for key, value in two["policies"]["gpt2"]["model"].items()
               if not value.equal(lockstep["policies"]["gpt2"]["model"][key])]
    assert differs, "a lag of 2 trained exactly as lockstep"


@pytest.mark.parametrize("source, target", [("two", "two"), ("one", "two")])
def test_a_resume_with_batches_in_flight_ends_equal(lagged, source, target):
    mid = lagged.parent / "runs" / source / "checkpoints" / "step=2.ckpt"
    version = f"resume-{source}-{target}"
    _ok(_mrl(lagged, "--trainer.version", version, "--ckpt_path", str(mid), *LAG, *DISJOINT))
    _assert_same_lagged_run(_ckpt(lagged, target), _ckpt(lagged, version), f"{source} -> {target}")


def test_a_resume_with_another_lag_is_refused_before_building(lagged):
    mid = lagged.parent / "runs" / "two" / "checkpoints" / "step=2.ckpt"
    proc = _mrl(lagged, "--trainer.version", "other", "--ckpt_path", str(mid))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.max_lag=0" in proc.stderr and "--trainer.max_lag 2" in proc.stderr
    # batches in flight were kept per rank: a policy on another number of ranks is refused before the build
    proc = _mrl(lagged, "--trainer.version", "wider", "--ckpt_path", str(mid), *LAG, "--trainer.devices", "2",
                "--trainer.strategy", "ddp", "--trainer.placement", "colocated")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "from 1 rank(s); this run gives 'gpt2' 2" in proc.stderr and "phase 'build'" not in proc.stderr


def test_pace_and_idle_tags_are_logged(lagged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(lagged.parent / "runs" / "two"))
    events.Reload()
    assert [e.step for e in events.Scalars("pace/staleness_steps")] == [1, 2, 3, 4, 5]
    # batch b was sampled after min(L, b - 1) fewer updates than it is trained at
    assert [e.value for e in events.Scalars("pace/staleness_steps")] == [0, 1, 2, 2, 2]
    for policy in ("gpt2", "llama"):
        shares = [e.value for e in events.Scalars(f"mwra/{policy}/idle_share")]
        assert len(shares) == 5 and all(0.0 <= v < 1.0 for v in shares)
