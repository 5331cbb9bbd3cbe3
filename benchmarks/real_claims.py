"""The paper's claims about the probes against the real pair's runs: the claims table of benchmarks/real_arms.py.

Each claim of docs/probes.md ("What the paper claims") and docs/bandit.md is tested by one
quantity of :func:`real_arms.summarize`'s tables, seed-paired with the control (``none``)
where it compares arms. The verdict is read off the 95% interval over seeds, never off the
mean alone:

- a claimed direction (``+`` / ``-``): "holds" when the interval lies on that side of 0
  (of 1 for a ratio), "opposite" when it lies on the other side, "not shown" when it
  contains 0 (1);
- a claimed absence (``0``): "consistent" when the interval contains 0 (1): not refuted, which
  with three seeds is a weak statement (the interval is wide), "does not hold" when it
  excludes it;
- a claimed bound (``>=0``: no worse than the control): "holds" when the interval lies above
  0, "consistent" when it contains 0, "does not hold" when it lies below;
- a ``+`` claim on a probe's own quantity that cannot be negative (a relative variance, a
  mean absolute shift) holds when the interval excludes 0: the figure says how large it is;
- a verdict that reads an unfinished run (``--include-unfinished``) ends in ``*``: whole-run
  numbers (the gradient, the rescue control) are not cut to the steps both runs have;
- the variance claims are read from the gradient's size (the RMS over steps of the norm before
  clipping, E||g||^2 = ||E g||^2 + the update's variance), a proxy: the paper's variance is
  the update's spread at a fixed policy, which the runs' logs do not hold, and a consistent
  extra direction (SGT's transfer) raises the RMS without adding variance;
- "one seed" where only one seed has the number (no interval), "no data" where none has,
  "not run" where the arm has no run.

Nothing of ``mrl_lightning`` is imported (the tables are plain dicts).
"""

from __future__ import annotations

import math

EXPECT_TEXT = {"+": "> 0", "-": "< 0", "0": "= 0", ">=0": ">= 0"}


def _side(lo: float, hi: float, at: float) -> int:
    return 1 if lo > at else -1 if hi < at else 0


def verdict(st: dict, expect: str, ratio: bool = False) -> str:
    """The verdict of one figure against the claimed ``expect`` (``+``, ``-``, ``0``, ``>=0``; module docstring).

    ``st``: ``{"mean", "ci95", "n"}`` (a difference or a positive quantity), or with ``ratio``
    ``{"mean", "factor", "n"}`` (a geometric-mean ratio with its multiplicative half-width),
    compared with 1.

    Raises:
        ValueError: ``expect`` is not one of the four.
    """
    if expect not in EXPECT_TEXT:
        raise ValueError(f"expect={expect!r}: one of {sorted(EXPECT_TEXT)}")
    if not st.get("n"):
        return "no data"
    if st["n"] < 2:
        return "one seed"
    if ratio:
        lo, hi, at, zero = st["mean"] / st["factor"], st["mean"] * st["factor"], 1.0, "1"
    else:
        lo, hi, at, zero = st["mean"] - st["ci95"], st["mean"] + st["ci95"], 0.0, "0"
    if math.isnan(lo) or math.isnan(hi):
        return "no data"
    side = _side(lo, hi, at)
    where = {1: f"interval above {zero}", -1: f"interval below {zero}", 0: f"interval includes {zero}"}[side]
    if expect == "0":  # three seeds cannot show an absence, only fail to refute it
        return f"consistent ({where})" if side == 0 else f"does not hold ({where})"
    if expect == ">=0":
        return {-1: f"does not hold ({where})", 0: f"consistent ({where})", 1: f"holds ({where})"}[side]
    wanted = 1 if expect == "+" else -1
    if side == wanted:
        return f"holds ({where})"
    return f"not shown ({where})" if side == 0 else f"opposite ({where})"


def _find(rows: list[dict], **match) -> dict | None:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found[0] if found else None


EMPTY = {"mean": math.nan, "ci95": math.nan, "n": 0}


def claims(t: dict, setup: dict, roles, cell, ratio_cell, control: str = "none") -> list[dict]:
    """The claims table: one row per claim and policy (part), each with its figure and verdict.

    ``t``: :func:`real_arms.summarize`'s tables; ``roles(setup, p)`` -> ``[(part, role)]``;
    ``cell`` / ``ratio_cell``: real_arms' formatting of a stat and of a ratio.
    Row keys: ``probe``, ``claim``, ``policy``, ``quantity``, ``figure`` (text), ``expect``,
    ``ratio``, ``verdict``, ``stat`` (the number the verdict reads).
    """
    arms = {r["arm"] for r in t["success"]}
    late = {r["arm"] for r in t["cost"] if r["unfinished"]}
    rows: list[dict] = []

    def add(probe, claim, policy, quantity, st, expect, figure=None, ratio=False, own=False):
        """One row; ``own``: the probe's own quantity (no control needed), else paired with the control."""
        ran = probe in arms and (control in arms or own)
        mark = " *" if probe in late or (control in late and not own) else ""
        rows.append({"probe": probe, "claim": claim, "policy": policy, "quantity": quantity,
                     "expect": expect, "ratio": ratio, "stat": st if ran else EMPTY,
                     "figure": (figure or (ratio_cell(st) if ratio else cell(st, signed=not own)))
                     if ran else "-",
                     "verdict": verdict(st, expect, ratio) + mark if ran else "not run"})

    def paired(arm, p, part, key):
        r = _find(t["paired"], arm=arm, policy=p, part=part)
        return (r or {}).get(key, EMPTY), (r or {}).get("early_steps") or []

    def number(table, arm, p, key):
        r = _find(t.get(table, []), arm=arm, policy=p)
        return (r or {}).get(key, EMPTY)

    policies = list(setup["policies"])
    weak = [(p, part) for p in policies for part, role in roles(setup, p) if role == "weak"]
    strong = [(p, part) for p in policies for part, role in roles(setup, p) if role == "strong"]
    vs = f"- {control}, paired"

    def support(arm, claim, expect):
        for p, part in weak:
            sampled, _ = paired(arm, p, part, "sampled_end_diff")
            greedy, _ = paired(arm, p, part, "greedy_end_diff")
            add(arm, claim, p, f"{part} (weak): end success, {arm} {vs}, sampled", sampled, expect,
                figure=f"{cell(sampled, signed=True)} (greedy {cell(greedy, signed=True)})")

    def stable(arm, claim):
        for p, part in strong:
            r = _find(t["harm"], arm=arm, policy=p, part=part) or {}
            sampled, greedy = r.get("sampled_diff", EMPTY), r.get("greedy_diff", EMPTY)
            add(arm, claim, p, f"{part} (strong): worst drop, {arm} {vs}, sampled", sampled, ">=0",
                figure=f"{cell(sampled, signed=True)} (greedy {cell(greedy, signed=True)})")

    def gradient(arm, claim, expect):
        for p in policies:
            add(arm, claim, p, f"grad norm RMS, {arm} / {control}, paired", number("gradient", arm, p, "rms_ratio"),
                expect, ratio=True)

    def own(probe, claims_of):  # the probe's own positive quantities: (claim, quantity, key of its table)
        for p in policies:
            for claim, quantity, key in claims_of:
                add(probe, claim, p, quantity, number(probe, probe, p, key), "+", own=True)

    # SGT (docs/probes.md): rescue-set support at low variance, within about 20 steps
    support("sgt", "SGT adds support where the receiver's own group fails", "+")
    for p, part in weak:
        st, steps = paired("sgt", p, part, "sampled_early_diff")
        add("sgt", "SGT rescues within about 20 steps", p,
            f"{part} (weak): success at step {'/'.join(map(str, steps)) or '-'}, sgt {vs}, sampled", st, "+")
    for p in policies:
        add("sgt", "Prompts SGT rescued are later solved on-policy more often than others", p,
            f"later-solved gap (rescued - not), sgt {vs}", number("rescue", "sgt", p, "gap_diff"), "+")
    gradient("sgt", "SGT's update variance is below plain GRPO's (proxy: gradient size)", "-")
    stable("sgt", "SGT keeps the strong part (stability)")
    # PRP, is_mode truncate as shipped (callbacks/prp.yaml): no support; pays ratio variance and THL residual
    support("prp", "PRP with is_mode truncate adds no support", "0")
    own("prp", [("PRP pays density-ratio variance", "uncapped importance weights' Var(w) / mean(w)^2 (1/ESS - 1)",
                 "weight_rel_var_raw"),
                ("PRP pays THL residual", "share of pooled log-prob mass THL moved inside chunks", "thl_mass_moved")])
    gradient("prp", "PRP pays in update variance (proxy: gradient size)", "+")
    # XGRPO: stable, no support outside its own, a signal where GRPO's group has none
    gradient("xgrpo", "XGRPO stays stable (proxy: gradient size as none's)", "0")
    stable("xgrpo", "XGRPO stays stable (strong part)")
    support("xgrpo", "XGRPO adds no support outside its own", "0")
    own("xgrpo", [("An own zero-variance group with differing peers gets a signal (all-fail: negative)",
                   "share of own zero-variance groups given a non-zero advantage", "zero_var_signal_share"),
                  ("XGRPO changes the baseline", "mean abs(b - own mean) (reward units)", "baseline_shift")])
    return rows


def markdown(rows: list[dict], control: str = "none") -> list[str]:
    """The claims table as Markdown lines."""
    out = [f"Verdicts read the 95% interval over seeds (a difference against {control} on the seed, or the "
           "probe's own number): holds; not shown (the interval includes 0, or 1 for a ratio); opposite; for a "
           "claimed absence or bound, consistent (not refuted) or does not hold; one seed; no data; not run; "
           "* = read from an unfinished run.", "",
           "| probe | claim | policy | quantity | figure | claimed | verdict |", "|---|---|---|---|---|---|---|"]
    def esc(text: str) -> str:
        return str(text).replace("|", "\\|")

    out += ["| " + " | ".join(esc(c) for c in (
        r["probe"], r["claim"], r["policy"], r["quantity"], r["figure"],
        EXPECT_TEXT[r["expect"]].replace("0", "1") if r["ratio"] else EXPECT_TEXT[r["expect"]], r["verdict"])) + " |"
        for r in rows]
    return out
