"""Acceptance: the shapes docs/bandit.md reports (and a tabular prototype showed), on a
small fixed-seed ``mrl bandit`` run (32 contexts, 16 actions, G = 8, 120 steps, 4 replicas).

Definitions used by the assertions:

- Weak-context support of a family: exact probability mass on correct actions, averaged
  over that family's weak half (its rescue set: own groups almost never succeed there,
  the peer's almost always do) and over the 4 training replicas, after 120 steps.
- A probe "reaches support" when that number is >= ``SUPPORT_THRESHOLD`` = 0.5 for
  *both* families.
- A probe "adds no support" when each family's weak-context support rose by less than
  ``NO_SUPPORT_MARGIN`` = 0.01 (absolute mass) over its initial 0.001.
- Update variance: ``E ||U[x] - E U[x]||^2`` per weak context at the shared initial
  policies, estimated from 600 Monte-Carlo draws; "lower" means lower by more than three
  standard errors of both estimates.

Not asserted because it does not hold in this simulation (reported by ``mrl bandit``):
over *all* contexts PRP's update variance is below plain GRPO's and SGT's (pooling 16
samples steadies the strong half), and at an SGT weight that rescues as fast as
``prp-none`` (lambda_sgt = 0.5) SGT's weak-context variance is above PRP's.
"""

from __future__ import annotations

import pytest

from mrl_lightning.analysis.config import BanditConfig
from mrl_lightning.analysis.simulate import run_analysis

SUPPORT_THRESHOLD = 0.5
NO_SUPPORT_MARGIN = 0.01
PRP_MODES = ("prp-truncate", "prp-clip", "prp-none")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    cfg = BanditConfig(
        seed=0, num_contexts=32, num_actions=16, group_size=8, peer_samples=8, steps=120,
        replicas=4, mc_draws=600, checkpoints=1, sgt_extra_lambdas=(),
        support_threshold=SUPPORT_THRESHOLD,
    )
    return {p["name"]: p for p in run_analysis(cfg)["probes"]}


def _gain(p: dict, fam: str) -> float:
    return p["support_weak_final"][fam] - p["support_weak_init"][fam]


def _lower(a: dict, b: dict) -> bool:
    """``a``'s weak-context variance is below ``b``'s by more than 3 standard errors each."""
    return a["variance_weak"] + 3 * a["variance_weak_se"] < b["variance_weak"] - 3 * b["variance_weak_se"]


def test_sgt_reaches_support_on_each_family_weak_contexts(results):
    sgt = results["sgt"]
    assert sgt["reaches_support"], sgt["support_weak_final"]
    for fam in ("A", "B"):
        assert sgt["support_weak_final"][fam] >= SUPPORT_THRESHOLD


def test_sgt_has_lower_weak_variance_than_every_prp_mode_that_reaches_support(results):
    reaching = [m for m in PRP_MODES if results[m]["reaches_support"]]
    assert reaching, "no PRP mode reached support: the comparison would be vacuous"
    for mode in reaching:
        assert _lower(results["sgt"]["init"], results[mode]["init"]), (
            mode, results["sgt"]["init"]["variance_weak"], results[mode]["init"]["variance_weak"])


def test_prp_truncate_adds_no_weak_context_support(results):
    p = results["prp-truncate"]
    assert not p["reaches_support"]
    for fam in ("A", "B"):
        assert _gain(p, fam) < NO_SUPPORT_MARGIN, (fam, p["support_weak_final"][fam])


def test_xgrpo_adds_no_support_beyond_plain_grpo(results):
    x, none = results["xgrpo"], results["none"]
    assert not x["reaches_support"]
    for fam in ("A", "B"):
        assert x["support_weak_final"][fam] <= none["support_weak_final"][fam] + NO_SUPPORT_MARGIN
        assert _gain(x, fam) < NO_SUPPORT_MARGIN


def test_sharing_does_not_cost_the_strong_half(results):
    """Every probe keeps each family's strong half at or above its initial 0.9."""
    for name, p in results.items():
        for fam in ("A", "B"):
            assert p["success_strong_final"][fam] >= 0.9, (name, fam)
