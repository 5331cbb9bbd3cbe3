"""The real pair's probe arms compared over seeds, each paired with ``none`` on its seed (docs/real_models.md).

    python benchmarks/real_arms.py --out runs/real_arms
    python benchmarks/real_arms.py --out runs/real_arms --include-unfinished   # a study still running

Reads the runs that ``benchmarks/real_pair.py --arms none sgt prp xgrpo --seeds 0 1 2 --out
runs/real_arms`` writes: ``<out>/<arm>/seed<k>/`` (one TensorBoard events file, the resolved
``config.yaml``, a ``done`` marker once finished) and ``<out>/walls.json`` (``"<arm>/seed<k>"``
-> seconds of ``mrl fit``). Only finished runs are read unless ``--include-unfinished``; an
unfinished run is marked ``*`` and listed under the tables with its last logged step, and a
paired difference then compares the two runs up to the last evaluation both have. Policies,
their strong parts (``strong_parts``) and each part's number of held-out questions (its
``eval_size``) come from the run's ``config.yaml``. Nothing of ``mrl_lightning`` is imported.

Every cell is mean ± the 95% Student-t interval over seeds (``benchmarks/probes.py``
``mean_ci``; no interval with one seed, ``-`` with none); ``n`` is the number of seeds
that have the number. Written: ``<out>/comparison.md`` (printed too), ``comparison.json``
(every run's numbers and every table row) and ``curves.png``. The same folders give the
same tables.

1. Success: per arm, policy and part, at the first and the last evaluation:
   ``eval/<p>/success_<part>`` (sampled: the mean over the held-out questions of the share of
   ``eval_num_generations`` samples that are right) and ``eval/<p>/greedy_success_<part>``.
2. Paired with none: per seed, arm minus none, of the end success, of the rise (end -
   start) and of the success at the second evaluation (the first after the start), sampled
   and greedy.
3. Harm: the strong part's worst drop, min over the evaluations after the first of (success
   - first success), per run (positive when it never fell below its start); and arm minus
   none on the seed.
4. The control for rescue (docs/probes.md): among weak-part prompts drawn again, the share
   solved on-policy later, for those rescued before (under none: those SGT would have
   rescued) and for the others (``probe/sgt/<p>/later_solved_share_rescued`` and
   ``..._not_rescued``; ``probe/none/<p>/later_solved_share_would_be_rescued`` and
   ``..._not_rescued``; the last logged value, which counts the whole run), their gap, and
   SGT's gap minus none's on the seed. Also SGT's ``rescued_later_solved_share`` (every
   rescued prompt seen again, weak part or not). "no data" where no such prompt was drawn again.
5. Cost: seconds a step (``train/step_time_s``, mean over steps 2..end: step 1 pays the first
   allocations) and, paired on the seed, its ratio to none; ``train/exchange_time_s``; the wall
   time. Per policy the probe's own seconds a step (``train/<p>/aux_loss_time_s`` +
   ``compose_time_s``: its loss term's own forward/backward and the batch composing) and their
   share of ``train/<p>/update_time_s`` (which holds both). Under none the own seconds are the
   rescue control's bookkeeping.
   PRP (``probe/prp/<p>/``, over steps that weighted a unit): ``ess`` (per unit, 1 = equal
   weights) and the weights' relative variance ``1/ess - 1`` = Var(w) / mean(w)^2 over the
   step's tokens (exact: ess = mean(w)^2 / mean(w^2)), for the applied weights and, from
   ``ess_raw``, for the uncapped ratio; ``log_ratio_mean``; the largest ``log_ratio_abs_max``
   (nats); ``frac_capped``; peer samples pooled a step; the term's ``grad_share``; THL's
   ``thl/prp/<p>/logprob_mass_moved`` (share of the peers' log-prob mass split inside chunks).
   XGRPO: ``probe/xgrpo/<p>/baseline_shift`` (mean |b - own mean|, reward units) and the largest
   ``baseline_shift_max``; ``zero_var_signal_share``. SGT: ``probe/sgt/<p>/grad_share`` (mean over
   the steps with a transfer) and the largest ``grad_share_max``; transfers received (summed); THL
   mass moved of the demos.
   Gradient: per policy, the RMS over steps of ``train/<p>/grad_norm`` (before clipping; a
   step with no group that has a signal logs 0 and counts), its mean, the share of steps at 0,
   and, paired on the seed, the ratio of the RMS to none's (geometric mean over seeds; the
   95% interval of the mean log ratio, shown as a factor ×/÷).
6. The paper's claims (docs/probes.md) against these runs: ``real_claims.py``, each claim with
   the quantity above that tests it, its figure and a verdict read off its interval.
7. ``curves.png``: a panel per policy and part, sampled success against the step, one line per
   arm (the mean over seeds) in a band from the lowest to the highest seed.

Not a test (``tests/benchmarks/test_real_arms.py`` checks the arithmetic on synthetic runs).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_claims  # noqa: E402
from probes import mean_ci  # noqa: E402

ARM_ORDER = ("none", "sgt", "prp", "xgrpo")
STEADY_FROM = 2  # cost means start at this step (step 1 pays the first allocations)
KINDS = (("sampled", "success"), ("greedy", "greedy_success"))
# probe -> [(column, key of probe_numbers, digits)]: the probe tables of item 5
PROBE_COLUMNS = {
    "prp": [("ESS / unit", "ess", 3), ("weight rel. var", "weight_rel_var", 3),
            ("uncapped rel. var", "weight_rel_var_raw", 3), ("log ratio mean (nats)", "log_ratio_mean", 3),
            ("abs log ratio max (nats)", "log_ratio_abs_max", 2), ("frac capped", "frac_capped", 3),
            ("pooled / step", "peers_pooled", 2), ("grad share", "grad_share", 3),
            ("THL mass moved", "thl_mass_moved", 3)],
    "xgrpo": [("baseline shift", "baseline_shift", 4), ("baseline shift max", "baseline_shift_max", 3),
              ("zero-var signal share", "zero_var_signal_share", 3)],
    "sgt": [("grad share", "grad_share", 3), ("grad share max", "grad_share_max", 3),
            ("transfers received", "transfers", 1), ("THL mass moved", "thl_mass_moved", 3)],
}


# ---------------------------------------------------------------- reading one run


def find_runs(out: Path, include_unfinished: bool) -> list[dict]:
    """The ``<out>/<arm>/seed<k>`` folders to read, arms in :data:`ARM_ORDER` then by name, seeds by number."""
    runs = []
    for folder in sorted(out.glob("*/seed*")):
        match = re.fullmatch(r"seed(\d+)", folder.name)
        if not match or not folder.is_dir():
            continue
        finished = (folder / "done").exists()
        if finished or include_unfinished:
            runs.append({"arm": folder.parent.name, "seed": int(match.group(1)), "path": folder, "finished": finished})
    rank = {arm: i for i, arm in enumerate(ARM_ORDER)}
    return sorted(runs, key=lambda r: (rank.get(r["arm"], len(rank)), r["arm"], r["seed"]))


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] by step, the last value kept where a resumed run logged a step twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(p for p in run_dir.rglob("events.out.tfevents.*") if "checkpoints" not in p.parts)
    if not files:
        return {}
    acc = EventAccumulator(str(files[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: float(e.value) for e in acc.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    return out


def read_setup(run_dir: Path) -> dict:
    """Policies (name -> strong parts), parts (name -> held-out questions) and samples per question.

    Raises:
        FileNotFoundError: the run folder has no ``config.yaml`` (mrl fit writes it at the start).
    """
    path = run_dir / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: every run folder of mrl fit holds its resolved config; "
                                "was this folder written by benchmarks/real_pair.py?")
    cfg = yaml.safe_load(path.read_text())
    data = cfg["data"]["init_args"]
    parts = {part["name"]: part.get("eval_size") or data.get("eval_size") for part in data["parts"]}
    policies = {p["init_args"]["name"]: list(p["init_args"].get("strong_parts") or [])
                for p in cfg["model"]["policies"]}
    return {"policies": policies, "parts": parts, "samples": cfg["trainer"].get("eval_num_generations")}


def _values(s: dict, tag: str, from_step: int = 0) -> list[float]:
    return [v for step, v in s.get(tag, []) if step >= from_step]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _max(values: list[float]) -> float:
    return max(values) if values else math.nan


def _log(x: float) -> float:
    """log x; NaN where x <= 0 (a run whose every step had no gradient has no ratio)."""
    return math.log(x) if x > 0 else math.nan


def _last(s: dict, tag: str) -> float:
    return s[tag][-1][1] if s.get(tag) else math.nan


def probe_numbers(s: dict, p: str) -> dict[str, dict[str, float]]:
    """PRP, XGRPO and SGT numbers of item 5 for policy ``p`` (NaN where the probe logged nothing)."""
    prp, xgrpo, sgt = f"probe/prp/{p}/", f"probe/xgrpo/{p}/", f"probe/sgt/{p}/"
    units = dict(s.get(prp + "units", []))
    weighted = {k for k, n in units.items() if n > 0}  # a step without units logs ess 0

    def on_units(key: str) -> list[float]:
        return [v for step, v in s.get(prp + key, []) if step in weighted]

    return {
        "prp": {"ess": _mean(on_units("ess")),
                "weight_rel_var": _mean([1.0 / v - 1.0 for v in on_units("ess") if v > 0]),
                "weight_rel_var_raw": _mean([1.0 / v - 1.0 for v in on_units("ess_raw") if v > 0]),
                "log_ratio_mean": _mean(on_units("log_ratio_mean")),
                "log_ratio_abs_max": _max(on_units("log_ratio_abs_max")),
                "frac_capped": _mean(on_units("frac_capped")),
                "peers_pooled": _mean(_values(s, prp + "peers_pooled")),
                "grad_share": _mean(_values(s, prp + "grad_share")),
                "thl_mass_moved": _mean(_values(s, f"thl/prp/{p}/logprob_mass_moved"))},
        "xgrpo": {"baseline_shift": _mean(_values(s, xgrpo + "baseline_shift")),
                  "baseline_shift_max": _max(_values(s, xgrpo + "baseline_shift_max")),
                  "zero_var_signal_share": _mean(_values(s, xgrpo + "zero_var_signal_share"))},
        "sgt": {"grad_share": _mean(_values(s, sgt + "grad_share")),
                "grad_share_max": _max(_values(s, sgt + "grad_share_max")),
                "transfers": sum(_values(s, sgt + "transfers")) if s.get(sgt + "transfers") else math.nan,
                "thl_mass_moved": _mean(_values(s, f"thl/sgt/{p}/logprob_mass_moved"))},
    }


def run_numbers(s: dict, setup: dict) -> dict:
    """Everything one run contributes: eval curves, rescue control and cost, per policy."""
    policies = {}
    for p, strong in setup["policies"].items():
        curves = {kind: {part: [list(x) for x in s.get(f"eval/{p}/{prefix}_{part}", [])] for part in setup["parts"]}
                  for kind, prefix in KINDS}
        marked = _last(s, f"probe/sgt/{p}/later_solved_share_rescued")
        unmarked = _last(s, f"probe/sgt/{p}/later_solved_share_not_rescued")
        if math.isnan(marked) and math.isnan(unmarked):
            marked = _last(s, f"probe/none/{p}/later_solved_share_would_be_rescued")
            unmarked = _last(s, f"probe/none/{p}/later_solved_share_not_rescued")
        own = dict(s.get(f"train/{p}/aux_loss_time_s", []))
        compose = dict(s.get(f"train/{p}/compose_time_s", []))
        steps = sorted(k for k in set(own) | set(compose) if k >= STEADY_FROM)
        own_s = [own.get(k, 0.0) + compose.get(k, 0.0) for k in steps]
        update_s = _values(s, f"train/{p}/update_time_s", STEADY_FROM)
        grad = [v for v in _values(s, f"train/{p}/grad_norm", STEADY_FROM) if math.isfinite(v)]
        policies[p] = {
            "strong_parts": strong, "curves": curves,
            "grad": {"rms": math.sqrt(_mean([g * g for g in grad])), "mean": _mean(grad),
                     "zero_share": _mean([float(g == 0.0) for g in grad])},
            "rescue": {"marked": marked, "not_rescued": unmarked, "gap": marked - unmarked,
                       "rescued_later_solved_share": _last(s, f"probe/sgt/{p}/rescued_later_solved_share")},
            "cost": {"own_s": _mean(own_s), "update_s": _mean(update_s),
                     "own_share": sum(own_s) / sum(update_s) if own_s and update_s and sum(update_s) else math.nan},
            **probe_numbers(s, p),
        }
    logged = [steps[-1][0] for tag, steps in s.items() if tag.startswith("train/") and steps]
    return {"policies": policies, "last_step": max(logged, default=0),
            "step_time_s": _mean(_values(s, "train/step_time_s", STEADY_FROM)),
            "exchange_time_s": _mean(_values(s, "train/exchange_time_s", STEADY_FROM))}


# ---------------------------------------------------------------- numbers of a curve, statistics


def up_to(curve: list, step: float) -> list:
    """The evaluations of ``curve`` at or before ``step``."""
    return [x for x in curve if x[0] <= step]


def start(curve: list) -> float:
    return curve[0][1] if curve else math.nan


def end(curve: list) -> float:
    return curve[-1][1] if curve else math.nan


def rise(curve: list) -> float:
    return end(curve) - start(curve)


def early(curve: list) -> float:
    """The second evaluation (the first after the start); NaN with fewer than two."""
    return curve[1][1] if len(curve) > 1 else math.nan


def worst_drop(curve: list) -> float:
    """min over the evaluations after the first of (success - first success); NaN with fewer than two."""
    return min(v - curve[0][1] for _, v in curve[1:]) if len(curve) > 1 else math.nan


def stat(values: list[float]) -> dict:
    """Mean, 95% Student-t half-width and count of the finite values (``probes.mean_ci``)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    mean, half = mean_ci(finite)
    return {"mean": mean, "ci95": half, "n": len(finite)}


def paired_stat(mine: dict, theirs: dict, number) -> dict:
    """Seed-paired ``number(mine) - number(theirs)``; ``mine``/``theirs``: seed -> curve, each seed's pair kept
    to the evaluation steps both curves have (a run that missed an evaluation, or stopped early, is
    compared at the same steps, never by position)."""
    diffs = []
    for seed in sorted(set(mine) & set(theirs)):
        a, b = common_steps(mine[seed], theirs[seed])
        diffs.append(number(a) - number(b) if a and b else math.nan)
    return stat(diffs)


def common_steps(a: list, b: list) -> tuple[list, list]:
    """``a`` and ``b`` kept to the steps both have."""
    both = {x[0] for x in a} & {x[0] for x in b}
    return [x for x in a if x[0] in both], [x for x in b if x[0] in both]


# ---------------------------------------------------------------- the tables


def roles(setup: dict, p: str) -> list[tuple[str, str]]:
    """``(part, "strong" | "weak")`` of policy ``p``, strong parts first, each in the config's order."""
    strong = setup["policies"][p]
    return [(part, "strong") for part in setup["parts"] if part in strong] + \
        [(part, "weak") for part in setup["parts"] if part not in strong]


def summarize(runs: list[dict], setup: dict, control: str = "none") -> dict:
    """The rows of every table (module docstring, items 1-5) from the runs' numbers."""
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    of = {arm: {r["seed"]: r for r in runs if r["arm"] == arm} for arm in arms}
    rivals = [arm for arm in arms if arm != control and control in of]

    def curves(arm, p, kind, part):
        return {seed: r["policies"][p]["curves"][kind][part] for seed, r in of[arm].items()}

    def over(arm, get):
        return stat([get(r) for r in of[arm].values()])

    def paired_over(arm, get):
        common = sorted(set(of[arm]) & set(of[control]))
        return stat([get(of[arm][s]) - get(of[control][s]) for s in common])

    t = {"success": [], "paired": [], "harm": [], "rescue": [], "cost": [], "policy_cost": [], "gradient": [],
         **{probe: [] for probe in PROBE_COLUMNS}}
    for arm in arms:
        unfinished = [s for s, r in of[arm].items() if not r["finished"]]
        for p in setup["policies"]:
            for part, role in roles(setup, p):
                row = {"arm": arm, "policy": p, "part": part, "role": role, "questions": setup["parts"][part],
                       "seeds": len(of[arm]), "unfinished": unfinished}
                for kind, _ in KINDS:
                    c = curves(arm, p, kind, part)
                    row[f"{kind}_start"] = stat([start(x) for x in c.values()])
                    row[f"{kind}_end"] = stat([end(x) for x in c.values()])
                t["success"].append(row)
                if arm in rivals:
                    diff = {"arm": arm, "policy": p, "part": part, "role": role}
                    for kind, _ in KINDS:
                        mine, theirs = curves(arm, p, kind, part), curves(control, p, kind, part)
                        diff[f"{kind}_end_diff"] = paired_stat(mine, theirs, end)
                        diff[f"{kind}_rise_diff"] = paired_stat(mine, theirs, rise)
                        diff[f"{kind}_early_diff"] = paired_stat(mine, theirs, early)
                    mine, theirs = curves(arm, p, "sampled", part), curves(control, p, "sampled", part)
                    pairs = [common_steps(mine[k], theirs[k]) for k in sorted(set(mine) & set(theirs))]
                    diff["early_steps"] = sorted({a[1][0] for a, _ in pairs if len(a) > 1})
                    t["paired"].append(diff)
                if role == "strong":
                    harm = {"arm": arm, "policy": p, "part": part}
                    for kind, _ in KINDS:
                        mine = curves(arm, p, kind, part)
                        harm[f"{kind}_worst_drop"] = stat([worst_drop(x) for x in mine.values()])
                        harm[f"{kind}_diff"] = paired_stat(mine, curves(control, p, kind, part), worst_drop) \
                            if arm in rivals else stat([])
                    t["harm"].append(harm)
            if arm == control or arm.startswith("sgt"):
                row = {"arm": arm, "policy": p}
                for key in ("marked", "not_rescued", "gap", "rescued_later_solved_share"):
                    row[key] = over(arm, lambda r, key=key: r["policies"][p]["rescue"][key])
                row["gap_diff"] = paired_over(arm, lambda r: r["policies"][p]["rescue"]["gap"]) \
                    if arm in rivals else stat([])
                t["rescue"].append(row)
            t["policy_cost"].append({"arm": arm, "policy": p, **{
                key: over(arm, lambda r, key=key: r["policies"][p]["cost"][key])
                for key in ("own_s", "update_s", "own_share")}})
            grad = {"arm": arm, "policy": p, **{key: over(arm, lambda r, key=key: r["policies"][p]["grad"][key])
                                                for key in ("rms", "mean", "zero_share")}}
            grad["rms_ratio"] = paired_over(arm, lambda r: _log(r["policies"][p]["grad"]["rms"])) \
                if arm in rivals else stat([])
            if grad["rms_ratio"]["n"]:  # the interval of the mean log ratio, as a ratio: exp(mean), exp(± half)
                grad["rms_ratio"] = {"mean": math.exp(grad["rms_ratio"]["mean"]),
                                     "factor": math.exp(grad["rms_ratio"]["ci95"]), "n": grad["rms_ratio"]["n"]}
            t["gradient"].append(grad)
            for probe, columns in PROBE_COLUMNS.items():
                row = {"arm": arm, "policy": p, **{key: over(arm, lambda r, key=key: r["policies"][p][probe][key])
                                                   for _, key, _ in columns}}
                if any(row[key]["n"] for _, key, _ in columns):
                    t[probe].append(row)
        t["cost"].append({
            "arm": arm, "seeds": len(of[arm]), "unfinished": unfinished,
            "step_time_s": over(arm, lambda r: r["step_time_s"]),
            "step_time_ratio": stat([of[arm][s]["step_time_s"] / of[control][s]["step_time_s"]
                                     for s in sorted(set(of[arm]) & set(of[control]))]) if arm in rivals else stat([]),
            "exchange_time_s": over(arm, lambda r: r["exchange_time_s"]),
            "wall_s": over(arm, lambda r: r["wall_s"])})
    t["claims"] = real_claims.claims(t, setup, roles, cell, ratio_cell, control)
    return t


def cell(st: dict, digits: int = 3, signed: bool = False, empty: str = "-") -> str:
    """``mean ± half-width`` (no interval with one value; ``empty`` with none)."""
    if not st["n"]:
        return empty
    sign = "+" if signed else ""
    text = f"{st['mean']:{sign}.{digits}f}"
    return text if math.isnan(st["ci95"]) else f"{text} ± {st['ci95']:.{digits}f}"


def ratio_cell(st: dict, digits: int = 2) -> str:
    """``ratio ×/÷ factor`` of a paired log-ratio (``-`` with no pair, no factor with one)."""
    if not st["n"]:
        return "-"
    text = f"{st['mean']:.{digits}f}"
    return text if math.isnan(st["factor"]) else f"{text} ×/÷ {st['factor']:.{digits}f}"


def _seeds(row: dict) -> str:
    return f"{row['seeds']}" + ("*" if row["unfinished"] else "")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells):  # a '|' inside a name (a policy, a part) would split its cell
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def markdown(t: dict, runs: list[dict], setup: dict, control: str) -> str:
    """The tables of :func:`summarize` as Markdown (no timestamps: the same runs give the same text)."""
    questions = ", ".join(f"{part} {n}" for part, n in setup["parts"].items())
    arms = ", ".join(f"{arm} (seeds {' '.join(str(r['seed']) for r in runs if r['arm'] == arm)})"
                     for arm in dict.fromkeys(r["arm"] for r in runs))
    out = [f"Runs: {arms}. Mean ± 95% interval over seeds (Student t); n = seeds, * = one of them unfinished.",
           f"Held-out questions: {questions}. Sampled success = mean over the questions of the share of "
           f"{setup['samples']} samples right; greedy = one greedy answer each.", "",
           "## 1. Success, first -> last evaluation", ""]
    out += _table(["arm", "policy", "part (questions)", "n", "sampled start", "sampled end", "greedy start",
                   "greedy end"],
                  [[r["arm"], r["policy"], f"{r['part']} ({r['role']}, {r['questions']} q)", _seeds(r),
                    cell(r["sampled_start"]), cell(r["sampled_end"]), cell(r["greedy_start"]), cell(r["greedy_end"])]
                   for r in t["success"]])
    out += ["", f"## 2. Paired with {control} on the seed: arm - {control}", ""]
    out += _table(["arm", "policy", "part", "pairs", "end, sampled", "end, greedy", "rise, sampled", "rise, greedy",
                   "2nd evaluation, sampled", "2nd evaluation, greedy"],
                  [[r["arm"], r["policy"], f"{r['part']} ({r['role']})", str(r["sampled_end_diff"]["n"]),
                    *(cell(r[f"{k}_{m}_diff"], signed=True) for m in ("end", "rise", "early")
                      for k in ("sampled", "greedy"))]
                   for r in t["paired"]] or [["-"] * 10])
    early_steps = sorted({k for r in t["paired"] for k in r["early_steps"]})
    if early_steps:
        out += ["", f"2nd evaluation: step {', '.join(map(str, early_steps))} (the first after the start)."]
    out += ["", "## 3. Harm: the strong part's worst drop, min over later evaluations of (success - start)", ""]
    out += _table(["arm", "policy", "strong part", "worst drop, sampled", "worst drop, greedy",
                   f"- {control}, sampled", f"- {control}, greedy"],
                  [[r["arm"], r["policy"], r["part"], cell(r["sampled_worst_drop"], signed=True),
                    cell(r["greedy_worst_drop"], signed=True), cell(r["sampled_diff"], signed=True),
                    cell(r["greedy_diff"], signed=True)] for r in t["harm"]])
    out += ["", "## 4. The control for rescue: weak-part prompts drawn again, share solved later", "",
            f"Rescued = SGT transferred a success for it earlier (under {control}: SGT would have). "
            "Gap = rescued - not rescued.", ""]
    nodata = "no data"
    out += _table(["arm", "policy", "rescued (would-be)", "not rescued", "gap", f"gap - {control}'s",
                   "SGT rescued_later_solved_share"],
                  [[r["arm"], r["policy"], cell(r["marked"], empty=nodata), cell(r["not_rescued"], empty=nodata),
                    cell(r["gap"], signed=True, empty=nodata), cell(r["gap_diff"], signed=True),
                    cell(r["rescued_later_solved_share"], empty="-" if r["arm"] == control else nodata)]
                   for r in t["rescue"]] or [["-"] * 7])
    out += ["", f"## 5. Cost (means over steps {STEADY_FROM}..end)", ""]
    out += _table(["arm", "n", "s / step", f"/ {control}'s (paired)", "exchange s / step", "wall s"],
                  [[r["arm"], _seeds(r), cell(r["step_time_s"], 2), cell(r["step_time_ratio"], 3),
                    cell(r["exchange_time_s"], 3), cell(r["wall_s"], 0)] for r in t["cost"]])
    out += [""]
    out += _table(["arm", "policy", "probe's own s / step (aux + compose)", "update s / step", "own share of update"],
                  [[r["arm"], r["policy"], cell(r["own_s"], 3), cell(r["update_s"], 2), cell(r["own_share"], 3)]
                   for r in t["policy_cost"]])
    out += ["", f"Gradient (``train/<p>/grad_norm``, before clipping, steps {STEADY_FROM}..end): the RMS over steps "
            f"(E||g||^2 = ||E g||^2 + the update's variance), its ratio to {control}'s on the seed (geometric mean "
            "over seeds, 95% interval as a factor), and the share of steps with no gradient (no group with a signal).",
            ""]
    out += _table(["arm", "policy", "grad norm RMS", "grad norm mean", f"RMS / {control}'s (paired)",
                   "steps with grad 0"],
                  [[r["arm"], r["policy"], cell(r["rms"], 3), cell(r["mean"], 3), ratio_cell(r["rms_ratio"]),
                    cell(r["zero_share"], 3)] for r in t["gradient"]])
    for probe, columns in PROBE_COLUMNS.items():
        if t[probe]:
            out += ["", f"{probe.upper()} (`probe/{probe}/<p>/...`):", ""]
            out += _table(["arm", "policy", *(name for name, _, _ in columns)],
                          [[r["arm"], r["policy"], *(cell(r[key], digits) for _, key, digits in columns)]
                           for r in t[probe]])
    out += ["", "## 6. The paper's claims (docs/probes.md) against these runs", ""]
    out += real_claims.markdown(t["claims"], control)
    late = [r for r in runs if not r["finished"]]
    if late:
        def last_eval(r):
            return max((c[-1][0] for p in r["policies"].values() for c in p["curves"]["sampled"].values() if c),
                       default="-")

        out += ["", "Unfinished (*): " + ", ".join(
            f"{r['arm']}/seed{r['seed']} (logged to step {r['last_step']}, last evaluation at step {last_eval(r)})"
            for r in late)]
    return "\n".join(out) + "\n"


def plot_curves(runs: list[dict], setup: dict, path: Path) -> None:
    """``curves.png``: per policy and part, sampled success by step, per arm the seeds' mean and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(setup["policies"])
    width = max(len(roles(setup, p)) for p in policies)
    fig, axes = plt.subplots(len(policies), width, figsize=(5 * width, 3.6 * len(policies)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    for i, p in enumerate(policies):
        for j, (part, role) in enumerate(roles(setup, p)):
            ax = axes[i][j]
            for k, arm in enumerate(arms):
                by_step: dict[int, list[float]] = {}
                for r in runs:
                    if r["arm"] == arm:
                        for step, v in r["policies"][p]["curves"]["sampled"][part]:
                            by_step.setdefault(step, []).append(v)
                if not by_step:
                    continue
                steps = sorted(by_step)
                n = max(len(v) for v in by_step.values())
                color = colors[(ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER) + k) % len(colors)]
                ax.plot(steps, [_mean(by_step[s]) for s in steps], marker="o", markersize=3, color=color,
                        label=f"{arm} ({n} seed{'s' if n > 1 else ''})")
                ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                                color=color, alpha=0.15, linewidth=0)
            ax.set_title(f"{p}: {part} ({role}, {setup['parts'][part]} questions)")
            ax.set_xlabel("step")
            ax.set_ylabel(f"sampled success ({setup['samples']} per question)")
            ax.set_ylim(-0.02, 1.02)
            ax.legend(fontsize=7)
        for j in range(len(roles(setup, p)), width):
            axes[i][j].axis("off")
    fig.suptitle("held-out success: mean over seeds, band = lowest to highest seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(obj):
    """``obj`` with NaN and infinities as None (strict JSON) and paths as text."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def read_walls(path: Path) -> dict[str, float]:
    """``walls.json``: ``"<arm>/seed<k>"`` -> seconds of ``mrl fit`` ({} when the file is absent).

    Raises:
        ValueError: the file is not a JSON object of numbers (names the file).
    """
    if not path.exists():
        return {}
    try:
        walls = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete it to compare without wall times") from None
    if not isinstance(walls, dict) or not all(isinstance(v, (int, float)) for v in walls.values()):
        raise ValueError(f"{path} must map \"<arm>/seed<k>\" to seconds (numbers); delete it to compare "
                         "without wall times")
    return walls


def compare(out: Path, include_unfinished: bool = False, control: str = "none", plot: bool = True) -> dict:
    """Read the runs under ``out``, write comparison.md / .json and curves.png; return what was written.

    Raises:
        FileNotFoundError: ``out`` does not exist, holds no run folder to read, or one without its ``config.yaml``.
        ValueError: runs with different policy names, strong parts or held-out parts (not one study; the
            policies' models and hyperparameters are not compared), ``control`` has no run, a finished run
            logged no evaluation, or ``walls.json`` is not an object of seconds.
    """
    if not out.is_dir():
        raise FileNotFoundError(f"--out {out} does not exist: give the study folder benchmarks/real_pair.py wrote")
    runs = find_runs(out, include_unfinished)
    if not runs:
        hint = "" if include_unfinished else " (none finished yet? --include-unfinished reads partial runs)"
        raise FileNotFoundError(f"no <arm>/seed<k> run folder to read under {out}{hint}")
    arms = sorted({r["arm"] for r in runs})
    if control not in arms:
        raise ValueError(f"--control {control!r} has no run under {out} (arms found: {', '.join(arms)}): "
                         "name one of them")
    walls = read_walls(out / "walls.json")
    setup = None
    for run in runs:
        mine = read_setup(run["path"])
        if setup is not None and mine != setup:
            raise ValueError(f"{run['path']} was run with {mine}, the runs before it with {setup}: compare runs "
                             "of one study (the same config apart from the probe and the seed)")
        setup = mine
        scalars = read_scalars(run["path"])
        if run["finished"] and not any(tag.startswith("eval/") for tag in scalars):
            raise ValueError(f"{run['path']} logged no evaluation (no eval/ scalars in its events file): the "
                             "tables compare held-out success; was it run with trainer.eval_every_n_steps 0?")
        run.update(run_numbers(scalars, setup))
        run["wall_s"] = float(walls.get(f"{run['arm']}/seed{run['seed']}", math.nan))
    tables = summarize(runs, setup, control)
    text = markdown(tables, runs, setup, control)
    (out / "comparison.md").write_text(text)
    saved = [{**r, "path": str(r["path"].relative_to(out))} for r in runs]
    (out / "comparison.json").write_text(json.dumps(_finite({"setup": setup, "control": control, "runs": saved,
                                                             "tables": tables}), indent=1) + "\n")
    if plot:
        plot_curves(runs, setup, out / "curves.png")
    return {"text": text, "runs": runs, "tables": tables, "setup": setup}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the study folder: <out>/<arm>/seed<k>/")
    parser.add_argument("--include-unfinished", action="store_true",
                        help="also read runs without their done marker (marked *)")
    parser.add_argument("--control", default="none", help="the arm every other arm is paired with")
    parser.add_argument("--no-plot", action="store_true", help="skip curves.png")
    args = parser.parse_args(argv)
    try:
        result = compare(args.out, args.include_unfinished, args.control, plot=not args.no_plot)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"real_arms: {err}") from None
    print(result["text"], end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
