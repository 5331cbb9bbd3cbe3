"""Writes the bandit analysis (docs/bandit.md): JSON, CSV, PNG figures and a summary table.

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


_SGT_EXTRA_MARKERS = ("^", "p", "h", "<", ">")
_LABEL_PT = 8  # label font size, points
_MARKER_S = 60  # scatter marker area, points^2


def probe_style(p: dict, index_among_extra_sgt: int = 0) -> tuple[str, str]:
    """(colour, marker) of one probe on the plane: colour by kind, marker unique per arm.

    Args:
        p: One entry of ``results["probes"]``.
        index_among_extra_sgt: Position of an extra SGT arm (``sgt@<lambda>``) among the extra ones.

    Returns:
        A matplotlib colour name and marker code.
    """
    if p["kind"] == "prp":
        return _COLORS["prp"], _MARKERS[p["is_mode"]]
    if p["kind"] == "sgt" and p["name"] != "sgt":
        return _COLORS["sgt"], _SGT_EXTRA_MARKERS[index_among_extra_sgt % len(_SGT_EXTRA_MARKERS)]
    return _COLORS[p["kind"]], {"none": "o", "xgrpo": "X", "sgt": "o"}[p["kind"]]


def _overlaps(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(
    points: list[tuple[float, float]], sizes: list[tuple[float, float]], frame: tuple[float, float, float, float],
    marker_radius: float,
) -> list[tuple[float, float]]:
    """Offsets that keep labels clear of each other, of every marker and inside the frame.

    Greedy: each label, in order, takes the first free slot among right/left of its point,
    then rows further up and down. All quantities are in points (1/72 inch) of display space.

    Args:
        points: ``[P]`` marker centres ``(x, y)``.
        sizes: ``[P]`` label ``(width, height)``.
        frame: ``(x0, y0, x1, y1)`` box the labels must stay inside (the axes).
        marker_radius: Half the marker's extent; labels keep this far from every centre.

    Returns:
        ``[P]`` offsets ``(dx, dy)`` of each label's lower-left corner from its point.
    """
    gap = 3.0
    placed: list[tuple[float, float, float, float]] = []
    markers = [(x - marker_radius, y - marker_radius, x + marker_radius, y + marker_radius) for x, y in points]
    out = []
    for (x, y), (w, h) in zip(points, sizes):
        candidates = []
        for row in range(0, 12):
            for dy in ((-h / 2,) if row == 0 else (-h / 2 + row * (h + 2), -h / 2 - row * (h + 2))):
                for dx in (marker_radius + gap, -marker_radius - gap - w):
                    candidates.append((dx, dy))
        choice = candidates[0]
        for dx, dy in candidates:
            box = (x + dx, y + dy, x + dx + w, y + dy + h)
            inside = frame[0] <= box[0] and box[2] <= frame[2] and frame[1] <= box[1] and box[3] <= frame[3]
            if inside and not any(_overlaps(box, o) for o in placed + markers):
                choice = (dx, dy)
                break
        placed.append((x + choice[0], y + choice[1], x + choice[0] + w, y + choice[1] + h))
        out.append(choice)
    return out


def plot_plane(results: dict, path: Path) -> None:
    """Writes the stability-support plane (:func:`plane_figure`) as a PNG.

    Args:
        results: Output of ``run_analysis``.
        path: PNG to write.
    """
    fig = plane_figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plane_figure(results: dict):
    """The stability-support plane: one point per probe in four panels.

    Every arm has its own marker (colour by probe kind), explained in one legend below the
    panels, so no legend covers a point; each point also carries its name, placed clear of
    the other labels and markers (:func:`place_labels`), with a thin leader line when it
    had to move away from its point's row.

    Args:
        results: Output of ``run_analysis``.

    Returns:
        The matplotlib figure (the caller saves and closes it).
    """
    from matplotlib.lines import Line2D

    panels = (
        ("variance_weak", "update variance, weak contexts (per context)", True),
        ("variance", "update variance, all contexts (per context)", True),
        ("noise_to_signal_weak", "variance / ||E U||^2, weak contexts", True),
        ("share_lowering_weak", "share of updates lowering E[r | x], weak contexts", False),
    )
    cfg = results["config"]
    probes = results["probes"]
    init = sum(results["problem"]["initial_weak_support"].values()) / len(FAMILIES)
    extra = [p["name"] for p in probes if p["kind"] == "sgt" and p["name"] != "sgt"]
    styles = [probe_style(p, extra.index(p["name"]) if p["name"] in extra else 0) for p in probes]
    fig, axes = plt.subplots(2, 2, figsize=(11, 9), dpi=110)
    placed_axes = []
    for ax, (key, label, log) in zip(axes.ravel(), panels):
        xs = [max(p["init"][key], 1e-12) if log else p["init"][key] for p in probes]
        ys = [max(p["support_weak_final_mean"], 1e-12) for p in probes]
        for x, y, (color, marker) in zip(xs, ys, styles):
            ax.scatter([x], [y], s=_MARKER_S, color=color, marker=marker, edgecolor="k", alpha=0.85, zorder=3)
        if log:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(cfg["support_threshold"], ls="--", color="k", lw=0.8)
        ax.axhline(init, ls=":", color="gray", lw=0.8)
        ax.set_xlabel(label + " at step 0")
        ax.set_ylabel(f"weak-context support after {cfg['steps']} steps")
        ax.grid(alpha=0.3, which="both")
        ax.margins(x=0.15, y=0.12)
        placed_axes.append((ax, xs, ys))
    handles = [Line2D([], [], ls="", marker=m, color=c, markeredgecolor="k", markersize=8, label=p["name"])
               for p, (c, m) in zip(probes, styles)]
    handles += [Line2D([], [], ls="--", color="k", lw=0.8, label="support threshold"),
                Line2D([], [], ls=":", color="gray", lw=0.8, label="initial weak support")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.suptitle(
        f"Stability-support plane (N={cfg['num_contexts']}, K={cfg['num_actions']}, "
        f"G={cfg['group_size']}, THL residual={cfg['residual']}, seed={cfg['seed']})"
    )
    rows = -(-len(handles) // 5)
    fig.tight_layout(rect=(0, 0.01 + 0.022 * rows, 1, 1))
    renderer = fig.canvas.get_renderer()
    to_pt = 72.0 / fig.dpi
    radius = (_MARKER_S ** 0.5) / 2 + 1.5
    for ax, xs, ys in placed_axes:
        pix = ax.transData.transform(list(zip(xs, ys)))
        points = [(px * to_pt, py * to_pt) for px, py in pix]
        texts = [ax.annotate(p["name"], (x, y), textcoords="offset points", xytext=(0, 0), fontsize=_LABEL_PT,
                             ha="left", va="bottom", annotation_clip=False) for p, x, y in zip(probes, xs, ys)]
        sizes = []
        for t in texts:
            bb = t.get_window_extent(renderer)
            sizes.append((bb.width * to_pt, bb.height * to_pt))
        frame = ax.get_window_extent(renderer)
        box = (frame.x0 * to_pt + 2, frame.y0 * to_pt + 2, frame.x1 * to_pt - 2, frame.y1 * to_pt - 2)
        order = sorted(range(len(points)), key=lambda i: (-points[i][1], points[i][0]))
        offsets = place_labels([points[i] for i in order], [sizes[i] for i in order], box, radius)
        for i, (dx, dy) in zip(order, offsets):
            texts[i].xyann = (dx, dy)
            if abs(dy + sizes[i][1] / 2) > sizes[i][1]:  # moved off its point's row: draw a leader line
                texts[i].arrow_patch = None
                texts[i].remove()
                ax.annotate(probes[i]["name"], (xs[i], ys[i]), textcoords="offset points", xytext=(dx, dy),
                            fontsize=_LABEL_PT, ha="left", va="bottom", annotation_clip=False,
                            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.35", "shrinkA": 0,
                                        "shrinkB": radius})
    return fig


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
