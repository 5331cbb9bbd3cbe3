"""Writes the bandit analysis (SPEC 7): JSON, CSV, PNG figures and a summary table.

Files written into the output directory:

- ``bandit_results.json``: config, problem summary, every probe's measurements and curves.
- ``bandit_probes.csv``: one row per probe (stability, support, success numbers).
- ``bandit_curves.csv``: long format ``step, probe, family, half, expected_reward``.
- ``stability_support.png``: every probe (each PRP weight mode, each SGT weight) as a
  point, final weak-context support against four stability measures.
- ``success_over_training.png``: expected reward per family on its weak and strong
  contexts, every step, one line per probe.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend chosen first)

from mrl_lightning.analysis.bandit import FAMILIES  # noqa: E402

_COLORS = {"none": "tab:gray", "prp": "tab:red", "xgrpo": "tab:blue", "sgt": "tab:green"}
_MARKERS = {None: "o", "truncate": "v", "clip": "s", "none": "D"}

PROBE_COLUMNS = (
    "probe", "kind", "is_mode", "lambda_sgt",
    "variance", "variance_se", "variance_weak", "variance_weak_se", "variance_strong",
    "share_lowering", "share_lowering_weak", "noise_to_signal_weak",
    "expected_norm", "expected_norm_weak", "cos_to_gradient", "weak_push",
    "variance_trajectory_mean", "share_lowering_trajectory_mean",
    "support_weak_init_A", "support_weak_init_B", "support_weak_final_A", "support_weak_final_B",
    "support_weak_final_mean", "success_strong_final_A", "success_strong_final_B",
    "steps_to_support_A", "steps_to_support_B", "reaches_support",
)


def probe_row(p: dict) -> dict:
    """Flattens one probe result of :func:`~mrl_lightning.analysis.simulate.run_probe` to a CSV row.

    Args:
        p: One entry of ``results["probes"]``.

    Returns:
        Dict keyed by ``PROBE_COLUMNS``; measurements at step 0 (the shared initial policies).
    """
    row = {"probe": p["name"], "kind": p["kind"], "is_mode": p["is_mode"], "lambda_sgt": p["lambda_sgt"]}
    row.update({k: p["init"][k] for k in PROBE_COLUMNS if k in p["init"]})
    row["variance_trajectory_mean"] = p["variance_trajectory_mean"]
    row["share_lowering_trajectory_mean"] = p["share_lowering_trajectory_mean"]
    for fam in FAMILIES:
        row[f"support_weak_init_{fam}"] = p["support_weak_init"][fam]
        row[f"support_weak_final_{fam}"] = p["support_weak_final"][fam]
        row[f"success_strong_final_{fam}"] = p["success_strong_final"][fam]
        row[f"steps_to_support_{fam}"] = p["steps_to_support"][fam]
    row["support_weak_final_mean"] = p["support_weak_final_mean"]
    row["reaches_support"] = p["reaches_support"]
    return row


def write_results(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Writes every output file.

    Args:
        results: Output of :func:`~mrl_lightning.analysis.simulate.run_analysis`.
        out_dir: Directory, created if missing.

    Returns:
        Paths by kind: ``json``, ``probes_csv``, ``curves_csv``, ``plane_png``, ``success_png``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "bandit_results.json",
        "probes_csv": out / "bandit_probes.csv",
        "curves_csv": out / "bandit_curves.csv",
        "plane_png": out / "stability_support.png",
        "success_png": out / "success_over_training.png",
    }
    paths["json"].write_text(json.dumps(results, indent=1) + "\n")
    with paths["probes_csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=PROBE_COLUMNS)
        w.writeheader()
        for p in results["probes"]:
            w.writerow(probe_row(p))
    with paths["curves_csv"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "probe", "family", "half", "expected_reward"])
        for p in results["probes"]:
            for fam in FAMILIES:
                for half in ("weak", "strong"):
                    for t, v in enumerate(p["curves"][fam][half]):
                        w.writerow([t, p["name"], fam, half, f"{v:.6g}"])
    plot_plane(results, paths["plane_png"])
    plot_success(results, paths["success_png"])
    return paths


def plot_plane(results: dict, path: Path) -> None:
    """The stability-support plane: one point per probe in four panels.

    Args:
        results: Output of ``run_analysis``.
        path: PNG to write.
    """
    panels = (
        ("variance_weak", "update variance, weak contexts (per context)", True),
        ("variance", "update variance, all contexts (per context)", True),
        ("noise_to_signal_weak", "variance / ||E U||^2, weak contexts", True),
        ("share_lowering_weak", "share of updates lowering E[r | x], weak contexts", False),
    )
    cfg = results["config"]
    init = sum(results["problem"]["initial_weak_support"].values()) / len(FAMILIES)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    for ax, (key, label, log) in zip(axes.ravel(), panels):
        for idx, p in enumerate(results["probes"]):
            x = p["init"][key]
            y = p["support_weak_final_mean"]
            ax.scatter([max(x, 1e-12) if log else x], [y], s=60, color=_COLORS[p["kind"]],
                       marker=_MARKERS.get(p["is_mode"], "o"), edgecolor="k", zorder=3)
            ax.annotate(p["name"], (max(x, 1e-12) if log else x, y), textcoords="offset points",
                        xytext=(5, 4 - 9 * (idx % 3)), fontsize=8)
        if log:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(cfg["support_threshold"], ls="--", color="k", lw=0.8, label="support threshold")
        ax.axhline(init, ls=":", color="gray", lw=0.8, label="initial weak support")
        ax.set_xlabel(label + " at step 0")
        ax.set_ylabel(f"weak-context support after {cfg['steps']} steps")
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"Stability-support plane (N={cfg['num_contexts']}, K={cfg['num_actions']}, "
        f"G={cfg['group_size']}, THL residual={cfg['residual']}, seed={cfg['seed']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_success(results: dict, path: Path) -> None:
    """Success over training per probe, family and half.

    Args:
        results: Output of ``run_analysis``.
        path: PNG to write.
    """
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True, sharey=True)
    for r, fam in enumerate(FAMILIES):
        for c, half in enumerate(("weak", "strong")):
            ax = axes[r, c]
            for p in results["probes"]:
                ls = {"truncate": ":", "clip": "--", "none": "-."}.get(p["is_mode"], "-")
                if p["kind"] == "sgt" and p["name"] != "sgt":
                    ls = (0, (5, 1, 1, 1))
                ax.plot(p["curves"][fam][half], label=p["name"], color=_COLORS[p["kind"]], ls=ls)
            ax.set_title(f"family {fam}, its {half} contexts")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            if r == 1:
                ax.set_xlabel("SGD step")
            if c == 0:
                ax.set_ylabel("expected reward (exact)")
    axes[0, 0].legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(f"Success over training (mean of {cfg['replicas']} replicas, seed={cfg['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(results: dict) -> str:
    """A plain-text table of the headline numbers, one line per probe.

    Args:
        results: Output of ``run_analysis``.

    Returns:
        The table as a string (no trailing newline).
    """
    head = (f"{'probe':<13} {'var_weak':>9} {'var_all':>9} {'noise/sig':>9} {'lower_wk':>8} "
            f"{'supp_A':>7} {'supp_B':>7} {'strong_A':>8} {'strong_B':>8} {'t_supp':>7}")
    lines = [head, "-" * len(head)]
    for p in results["probes"]:
        i = p["init"]
        t = [p["steps_to_support"][f] for f in FAMILIES]
        t_s = "-" if None in t else str(max(t))
        lines.append(
            f"{p['name']:<13} {i['variance_weak']:>9.2e} {i['variance']:>9.2e} "
            f"{i['noise_to_signal_weak']:>9.3g} {i['share_lowering_weak']:>8.3f} "
            f"{p['support_weak_final']['A']:>7.4f} {p['support_weak_final']['B']:>7.4f} "
            f"{p['success_strong_final']['A']:>8.4f} {p['success_strong_final']['B']:>8.4f} {t_s:>7}"
        )
    return "\n".join(lines)
