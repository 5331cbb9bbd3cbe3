"""benchmarks/real_arms.py on synthetic run folders whose numbers are worked out by hand here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from benchmark_loader import load_benchmark

T2 = 4.303  # Student t, 97.5%, 2 degrees of freedom (3 seeds)
EVAL_STEPS = (0, 20, 40, 60)
CONFIG = {"seed_everything": 0, "trainer": {"eval_num_generations": 4},
          "model": {"policies": [{"init_args": {"name": "a", "strong_parts": ["x"]}},
                                 {"init_args": {"name": "b", "strong_parts": ["y"]}}]},
          "data": {"init_args": {"eval_size": 60, "parts": [{"name": "x"}, {"name": "y", "eval_size": 24}]}}}
# policy a's strong part x, sampled success at EVAL_STEPS, per arm and seed
STRONG = {"none": {0: [0.5, 0.4, 0.45, 0.2], 1: [0.6, 0.6, 0.55, 0.5], 2: [0.4, 0.3, 0.35, 0.8]},
          "sgt": {0: [0.5, 0.3, 0.4, 0.25], 1: [0.6, 0.5, 0.6, 0.6], 2: [0.4, 0.35, 0.2, 0.95]}}
# the control for rescue, last logged value: (rescued or would-be, not rescued)
RESCUE = {"none": {0: (0.5, 0.3), 1: (0.4, 0.3), 2: (0.6, 0.3)},
          "sgt": {0: (0.8, 0.4), 1: (0.6, 0.4), 2: (0.7, 0.4)}}
STEP_S = {"none": {0: 10.0, 1: 20.0, 2: 10.0}, "sgt": {0: 12.0, 1: 30.0, 2: 11.0}}
# policy a's gradient norm before clipping on steps 3..60 (step 2 has none: 0, step 1 is left out)
GRAD = {"none": {0: 2.0, 1: 4.0, 2: 1.0}, "sgt": {0: 3.0, 1: 8.0, 2: 2.5}}


@pytest.fixture(scope="module")
def real_arms():
    return load_benchmark("real_arms")


def write_run(root: Path, arm: str, seed: int, scalars: dict[str, list[tuple[int, float]]], done: bool = True):
    from torch.utils.tensorboard import SummaryWriter

    folder = root / arm / f"seed{seed}"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    writer = SummaryWriter(str(folder))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    if done:
        (folder / "done").write_text("1.0\n")


def synthetic_run(arm: str, seed: int, steps: int = 60) -> dict[str, list[tuple[int, float]]]:
    prefix = "sgt" if arm == "sgt" else "none"
    marked = "rescued" if arm == "sgt" else "would_be_rescued"
    hit, other = RESCUE[arm][seed]
    s = {"eval/a/success_x": [(k, v) for k, v in zip(EVAL_STEPS, STRONG[arm][seed]) if k <= steps],
         "eval/a/greedy_success_x": [(k, 0.5) for k in EVAL_STEPS if k <= steps],
         # an earlier, different value: the whole run's share is the last one
         f"probe/{prefix}/a/later_solved_share_{marked}": [(10, 0.0), (steps, hit)],
         f"probe/{prefix}/a/later_solved_share_not_rescued": [(10, 1.0), (steps, other)],
         "train/step_time_s": [(1, 100.0)] + [(k, STEP_S[arm][seed]) for k in range(2, steps + 1)],
         "train/a/update_time_s": [(1, 50.0)] + [(k, 4.0) for k in range(2, steps + 1)],
         "train/a/aux_loss_time_s": [(1, 50.0)] + [(k, 0.5 if arm == "sgt" else 0.0) for k in range(2, steps + 1)],
         "train/a/compose_time_s": [(1, 50.0)] + [(k, 0.5) for k in range(2, steps + 1)],
         "train/a/grad_norm": [(1, 100.0), (2, 0.0)] + [(k, GRAD[arm][seed]) for k in range(3, steps + 1)]}
    for part in ("x", "y"):
        for policy in ("a", "b"):
            s.setdefault(f"eval/{policy}/success_{part}", [(k, 0.1) for k in EVAL_STEPS if k <= steps])
            s.setdefault(f"eval/{policy}/greedy_success_{part}", [(k, 0.1) for k in EVAL_STEPS if k <= steps])
    return s


@pytest.fixture(scope="module")
def study(tmp_path_factory, real_arms):
    root = tmp_path_factory.mktemp("real_arms")
    for arm in ("none", "sgt"):
        for seed in (0, 1, 2):
            write_run(root, arm, seed, synthetic_run(arm, seed))
    write_run(root, "sgt", 3, synthetic_run("sgt", 0, steps=40), done=False)  # still running: not read by default
    (root / "walls.json").write_text(json.dumps({"none/seed0": 600.0, "sgt/seed0": 700.0}))
    return root, real_arms.compare(root, plot=True)


def row(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def ci(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T2 * sd / math.sqrt(n)


def test_paired_end_difference_pairs_each_seed_with_nones_same_seed(study):
    _, result = study
    diff = row(result["tables"]["paired"], arm="sgt", policy="a", part="x")["sampled_end_diff"]
    # sgt - none at step 60 per seed: 0.25 - 0.2, 0.6 - 0.5, 0.95 - 0.8 = 0.05, 0.10, 0.15
    assert diff["n"] == 3
    assert diff["mean"] == pytest.approx(0.10)
    assert diff["ci95"] == pytest.approx(T2 * 0.05 / math.sqrt(3))  # sd of (0.05, 0.10, 0.15) is 0.05
    # paired across the wrong seeds (sgt seed 0 with none seed 2, ...) the interval would be ~1.1 wide
    assert diff["ci95"] < 0.13


def test_strong_part_worst_drop_is_the_lowest_point_below_the_start(study):
    _, result = study
    harm = row(result["tables"]["harm"], arm="sgt", policy="a")
    # sgt: seed 0 min(0.3, 0.4, 0.25) - 0.5 = -0.25; seed 1 0.5 - 0.6 = -0.1; seed 2 0.2 - 0.4 = -0.2
    mean, half = ci([-0.25, -0.1, -0.2])
    assert harm["sampled_worst_drop"]["mean"] == pytest.approx(mean) == pytest.approx(-0.18333333)
    assert harm["sampled_worst_drop"]["ci95"] == pytest.approx(half)
    # none: -0.3, -0.1, -0.1; paired sgt - none: 0.05, 0.0, -0.1
    mean, half = ci([0.05, 0.0, -0.1])
    assert harm["sampled_diff"]["mean"] == pytest.approx(mean)
    assert harm["sampled_diff"]["ci95"] == pytest.approx(half)
    assert row(result["tables"]["harm"], arm="none", policy="a")["sampled_diff"]["n"] == 0


def test_start_and_end_are_the_first_and_last_evaluation_over_finished_seeds(study):
    _, result = study
    r = row(result["tables"]["success"], arm="sgt", policy="a", part="x")
    assert (r["role"], r["questions"], r["seeds"]) == ("strong", 60, 3)  # the unfinished seed 3 is left out
    assert r["sampled_start"]["mean"] == pytest.approx(0.5)
    assert r["sampled_end"]["mean"] == pytest.approx((0.25 + 0.6 + 0.95) / 3)
    assert row(result["tables"]["success"], arm="sgt", policy="b", part="y")["questions"] == 24
    assert [(r["policy"], r["part"], r["role"]) for r in result["tables"]["success"] if r["arm"] == "none"] == \
        [("a", "x", "strong"), ("a", "y", "weak"), ("b", "y", "strong"), ("b", "x", "weak")]


def test_rescue_gap_uses_the_last_logged_shares_and_pairs_with_nones_would_be_gap(study):
    _, result = study
    sgt = row(result["tables"]["rescue"], arm="sgt", policy="a")
    none = row(result["tables"]["rescue"], arm="none", policy="a")
    assert sgt["gap"]["mean"] == pytest.approx(0.3) and none["gap"]["mean"] == pytest.approx(0.2)
    mean, half = ci([0.2, 0.1, 0.0])  # gaps 0.4, 0.2, 0.3 against 0.2, 0.1, 0.3
    assert sgt["gap_diff"]["mean"] == pytest.approx(mean)
    assert sgt["gap_diff"]["ci95"] == pytest.approx(half)
    assert row(result["tables"]["rescue"], arm="sgt", policy="b")["gap"]["n"] == 0
    assert "no data" in result["text"]


def test_cost_skips_step_one_and_takes_the_paired_ratio(study):
    _, result = study
    cost = row(result["tables"]["cost"], arm="sgt")
    assert cost["step_time_s"]["mean"] == pytest.approx((12 + 30 + 11) / 3)
    mean, half = ci([1.2, 1.5, 1.1])
    assert cost["step_time_ratio"]["mean"] == pytest.approx(mean)
    assert cost["step_time_ratio"]["ci95"] == pytest.approx(half)
    assert cost["wall_s"] == {"mean": 700.0, "ci95": pytest.approx(math.nan, nan_ok=True), "n": 1}
    own = row(result["tables"]["policy_cost"], arm="sgt", policy="a")
    assert own["own_s"]["mean"] == pytest.approx(1.0) and own["own_share"]["mean"] == pytest.approx(0.25)


def test_written_files_and_a_rerun_prints_the_same_text(study, real_arms):
    root, result = study
    assert (root / "comparison.md").read_text() == result["text"]
    assert (root / "curves.png").stat().st_size > 0
    saved = json.loads((root / "comparison.json").read_text())
    assert [(r["arm"], r["seed"]) for r in saved["runs"]] == [(a, s) for a in ("none", "sgt") for s in (0, 1, 2)]
    assert real_arms.compare(root, plot=False)["text"] == result["text"]


def test_unfinished_run_is_read_on_request_and_paired_up_to_its_last_evaluation(study, real_arms):
    root, _ = study
    result = real_arms.compare(root, include_unfinished=True, plot=False)
    assert row(result["tables"]["success"], arm="sgt", policy="a", part="x")["seeds"] == 4
    assert "sgt/seed3 (logged to step 40, last evaluation at step 40)" in result["text"]
    # seed 3 has no none run to pair with: the pairs stay seeds 0-2
    assert row(result["tables"]["paired"], arm="sgt", policy="a", part="x")["sampled_end_diff"]["n"] == 3


def test_unfinished_pair_compares_both_runs_at_their_last_common_evaluation(real_arms):
    mine = {0: [[0, 0.5], [20, 0.3], [40, 0.4]]}
    theirs = {0: [[0, 0.5], [20, 0.4], [40, 0.45], [60, 0.9]]}
    assert real_arms.paired_stat(mine, theirs, real_arms.end)["mean"] == pytest.approx(0.4 - 0.45)
    assert real_arms.paired_stat(mine, theirs, real_arms.worst_drop)["mean"] == pytest.approx(-0.2 - -0.1)


def test_prp_weight_relative_variance_is_one_over_ess_minus_one_on_steps_with_units(real_arms):
    # ess per unit = mean(w)^2 / mean(w^2): weights (1, 0) give 1/2, so Var(w) / mean(w)^2 = 1
    s = {"probe/prp/a/units": [(1, 0.0), (2, 10.0), (3, 4.0)],
         "probe/prp/a/ess": [(1, 0.0), (2, 0.5), (3, 0.8)],
         "probe/prp/a/log_ratio_abs_max": [(1, 0.0), (2, 3.0), (3, 1.5)],
         "thl/prp/a/logprob_mass_moved": [(2, 0.1), (3, 0.3)]}
    prp = real_arms.probe_numbers(s, "a")["prp"]
    assert prp["ess"] == pytest.approx(0.65)  # the step without units (ess logged as 0) is left out
    assert prp["weight_rel_var"] == pytest.approx((1.0 + 0.25) / 2)
    assert prp["log_ratio_abs_max"] == 3.0 and prp["thl_mass_moved"] == pytest.approx(0.2)
    assert math.isnan(real_arms.probe_numbers(s, "a")["xgrpo"]["baseline_shift"])


def test_paired_second_evaluation_is_the_first_after_the_start(study):
    _, result = study
    r = row(result["tables"]["paired"], arm="sgt", policy="a", part="x")
    # step 20, sgt - none per seed: 0.3 - 0.4, 0.5 - 0.6, 0.35 - 0.3
    mean, half = ci([-0.1, -0.1, 0.05])
    assert r["early_steps"] == [20]
    assert r["sampled_early_diff"]["mean"] == pytest.approx(mean)
    assert r["sampled_early_diff"]["ci95"] == pytest.approx(half)


def test_gradient_rms_counts_steps_with_no_gradient_and_pairs_the_log_ratio(study):
    _, result = study
    g = row(result["tables"]["gradient"], arm="sgt", policy="a")
    # steps 2..60: one 0 and 58 values g: RMS = g * sqrt(58 / 59)
    assert g["rms"]["mean"] == pytest.approx((3.0 + 8.0 + 2.5) / 3 * math.sqrt(58 / 59))
    assert g["zero_share"]["mean"] == pytest.approx(1 / 59)
    # ratios 1.5, 2.0, 2.5 on the seeds: the geometric mean, the interval as a factor
    logs = [math.log(1.5), math.log(2.0), math.log(2.5)]
    mean, half = ci(logs)
    assert g["rms_ratio"]["mean"] == pytest.approx(math.exp(mean)) == pytest.approx(7.5 ** (1 / 3))
    assert g["rms_ratio"]["factor"] == pytest.approx(math.exp(half))
    assert row(result["tables"]["gradient"], arm="none", policy="a")["rms_ratio"]["n"] == 0


@pytest.mark.parametrize("st, expect, ratio, verdict", [
    ({"mean": 0.2, "ci95": 0.1, "n": 3}, "+", False, "holds (interval above 0)"),
    ({"mean": 0.2, "ci95": 0.3, "n": 3}, "+", False, "not shown (interval includes 0)"),
    ({"mean": -0.2, "ci95": 0.1, "n": 3}, "+", False, "opposite (interval below 0)"),
    ({"mean": 0.05, "ci95": 0.1, "n": 3}, "0", False, "consistent (interval includes 0)"),
    ({"mean": 0.3, "ci95": 0.1, "n": 3}, "0", False, "does not hold (interval above 0)"),
    ({"mean": -0.3, "ci95": 0.1, "n": 3}, ">=0", False, "does not hold (interval below 0)"),
    ({"mean": -0.05, "ci95": 0.1, "n": 3}, ">=0", False, "consistent (interval includes 0)"),
    ({"mean": 0.2, "ci95": 0.1, "n": 3}, ">=0", False, "holds (interval above 0)"),
    ({"mean": 1.33, "factor": 1.28, "n": 3}, "-", True, "opposite (interval above 1)"),
    ({"mean": 0.60, "factor": 2.23, "n": 3}, "-", True, "not shown (interval includes 1)"),
    ({"mean": 0.5, "factor": 1.5, "n": 3}, "-", True, "holds (interval below 1)"),
    ({"mean": 0.2, "ci95": math.nan, "n": 1}, "+", False, "one seed"),
    ({"mean": math.nan, "ci95": math.nan, "n": 0}, "+", False, "no data"),
])
def test_a_claims_verdict_reads_the_interval_not_the_mean(st, expect, ratio, verdict):
    claims = load_benchmark("real_claims")
    assert claims.verdict(st, expect, ratio) == verdict
    with pytest.raises(ValueError, match="expect='>'"):
        claims.verdict(st, ">")


def test_the_claims_table_reads_its_figures_from_the_tables_and_marks_arms_not_run(study):
    _, result = study
    rows = result["tables"]["claims"]
    stable = row(rows, probe="sgt", claim="SGT keeps the strong part (stability)", policy="a")
    harm = row(result["tables"]["harm"], arm="sgt", policy="a")
    assert stable["stat"] == harm["sampled_diff"] and stable["expect"] == ">=0"
    assert stable["verdict"] == "consistent (interval includes 0)"  # paired drops 0.05, 0.0, -0.1
    size = row(rows, probe="sgt", claim="SGT's update variance is below plain GRPO's (proxy: gradient size)",
               policy="a")
    assert size["verdict"] == "opposite (interval above 1)"  # ratios 1.5, 2.0, 2.5
    assert {r["verdict"] for r in rows if r["probe"] in ("prp", "xgrpo")} == {"not run"}
    assert "## 6. The paper's claims" in result["text"] and "| prp | PRP pays THL residual | a |" in result["text"]


def test_a_pair_is_compared_at_the_steps_both_runs_evaluated_not_by_position(real_arms):
    # the arm missed its step-20 evaluation: its second point is step 40, the control's is step 20
    mine = {0: [[0, 0.5], [40, 0.9], [60, 0.7]]}
    theirs = {0: [[0, 0.5], [20, 0.6], [40, 0.9], [60, 0.6]]}
    assert real_arms.paired_stat(mine, theirs, real_arms.early)["mean"] == pytest.approx(0.0)  # both at step 40
    assert real_arms.paired_stat(mine, theirs, real_arms.worst_drop)["mean"] == pytest.approx(0.2 - 0.1)


def test_a_run_with_no_gradient_on_any_step_has_no_ratio_and_does_not_stop_the_table(tmp_path, real_arms):
    for arm in ("none", "sgt"):
        for seed in (0, 1):
            s = synthetic_run(arm, seed)
            if arm == "sgt" and seed == 0:
                s["train/a/grad_norm"] = [(k, 0.0) for k in range(1, 61)]
            write_run(tmp_path, arm, seed, s)
    result = real_arms.compare(tmp_path, plot=False)
    g = row(result["tables"]["gradient"], arm="sgt", policy="a")
    assert g["rms_ratio"]["n"] == 1 and g["rms_ratio"]["mean"] == pytest.approx(8.0 / 4.0)  # seed 1 only
    assert g["zero_share"]["mean"] == pytest.approx((1.0 + 1 / 59) / 2)


def test_a_claim_read_from_an_unfinished_run_is_marked(study, real_arms):
    root, _ = study
    result = real_arms.compare(root, include_unfinished=True, plot=False)
    size = row(result["tables"]["claims"], probe="sgt", policy="a",
               claim="SGT's update variance is below plain GRPO's (proxy: gradient size)")
    assert size["verdict"].endswith(" *")


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("control", "--control 'rescue' has no run"),
    ("no_eval", "logged no evaluation"),
    ("walls_list", "walls.json must map"),
    ("walls_text", "walls.json is not valid JSON"),
])
def test_bad_input_is_refused_in_one_line_before_anything_is_written(tmp_path, real_arms, case, message):
    root = tmp_path / "study"
    control = "rescue" if case == "control" else "none"
    if case != "missing":
        for arm in ("none", "sgt"):
            s = synthetic_run(arm, 0)
            if case == "no_eval" and arm == "sgt":
                s = {tag: v for tag, v in s.items() if not tag.startswith("eval/")}
            write_run(root, arm, 0, s)
        if case.startswith("walls"):
            (root / "walls.json").write_text("[1, 2]" if case == "walls_list" else '{"none": [1,2')
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
        real_arms.compare(root, control=control, plot=False)
    assert not (root / "comparison.md").exists()
