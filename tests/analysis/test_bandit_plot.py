"""The stability-support figure stays readable: no label on a label, no legend on a point.

docs/bandit.md ("Figures"): every arm has its own marker, one legend sits below the
panels, and point labels are placed clear of each other and of the markers.
"""

from __future__ import annotations

import itertools
import json

import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

from mrl_lightning.analysis.config import BanditConfig
from mrl_lightning.analysis.report import place_labels, plane_figure, probe_style
from mrl_lightning.analysis.simulate import run_analysis

NAMES = [("none", "none", None), ("prp-truncate", "prp", "truncate"), ("prp-clip", "prp", "clip"),
         ("prp-none", "prp", "none"), ("xgrpo", "xgrpo", None), ("sgt", "sgt", None), ("sgt@0.5", "sgt", None),
         ("sgt@2", "sgt", None)]
KEYS = ("variance_weak", "variance", "noise_to_signal_weak", "share_lowering_weak")


def _results(points: dict[str, tuple[float, float]]) -> dict:
    """A results dict with each probe at (x for every panel, final weak support)."""
    probes = []
    for name, kind, mode in NAMES:
        x, y = points[name]
        probes.append({"name": name, "kind": kind, "is_mode": mode, "init": {k: x for k in KEYS},
                       "support_weak_final_mean": y})
    return {"config": {"support_threshold": 0.5, "steps": 200, "num_contexts": 64, "num_actions": 16,
                       "group_size": 8, "residual": 0.1, "seed": 0},
            "problem": {"initial_weak_support": {"A": 1e-3, "B": 1e-3}}, "probes": probes}


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _check_figure(fig) -> None:
    fig.canvas.draw()  # places every annotation
    renderer = fig.canvas.get_renderer()
    axes = fig.axes
    (legend,) = fig.legends
    legend_box = legend.get_window_extent(renderer)
    for ax in axes:
        assert not _overlap(legend_box, ax.get_window_extent(renderer)), "the legend covers a panel"
        assert ax.get_legend() is None
        boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text, not its leader line
        assert len(boxes) == len(NAMES)
        for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
            assert not _overlap(a, b), f"labels {ax.texts[i].get_text()!r} and {ax.texts[j].get_text()!r} overlap"
        frame = ax.get_window_extent(renderer)
        for t, box in zip(ax.texts, boxes):
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, t


def test_crowded_points_get_separate_labels_and_the_legend_stays_outside():
    # The shape seen in the default run: four arms on one spot, two more close by, two apart.
    crowd = {"none": (1e-3, 0.05), "prp-truncate": (2.7e-2, 9e-4), "prp-clip": (2.86e-2, 0.997),
             "prp-none": (2.87e-2, 0.997), "xgrpo": (2.1e-2, 1.5e-3), "sgt": (2.87e-2, 0.997),
             "sgt@0.5": (2.9e-2, 0.998), "sgt@2": (4.4e-2, 0.998)}
    fig = plane_figure(_results(crowd))
    try:
        _check_figure(fig)
    finally:
        plt.close(fig)


def test_every_arm_has_its_own_marker():
    styles = [probe_style({"name": n, "kind": k, "is_mode": m}, i) for i, (n, k, m) in
              enumerate([x for x in NAMES if x[0].startswith("sgt@")])]
    all_styles = [probe_style({"name": n, "kind": k, "is_mode": m}) for n, k, m in NAMES if "@" not in n] + styles
    assert len(set(all_styles)) == len(NAMES)


def test_place_labels_keeps_clear_of_labels_markers_and_frame():
    points = [(100.0, 100.0)] * 5 + [(104.0, 100.0)]
    sizes = [(40.0, 10.0)] * 6
    frame = (0.0, 0.0, 400.0, 300.0)
    offsets = place_labels(points, sizes, frame, marker_radius=5.0)
    boxes = [(x + dx, y + dy, x + dx + w, y + dy + h) for (x, y), (dx, dy), (w, h) in zip(points, offsets, sizes)]
    for a, b in itertools.combinations(boxes, 2):
        assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)
    for box in boxes:
        assert frame[0] <= box[0] and box[2] <= frame[2] and frame[1] <= box[1] and box[3] <= frame[3]
        for x, y in points:
            assert not (box[0] < x + 5 and x - 5 < box[2] and box[1] < y + 5 and y - 5 < box[3])


@pytest.mark.parametrize("seed", [0])
def test_figure_of_a_real_small_run_is_readable(seed):
    cfg = BanditConfig(seed=seed, num_contexts=8, num_actions=4, steps=6, replicas=2, mc_draws=50, checkpoints=2,
                       group_size=4, peer_samples=4, sgt_extra_lambdas=(0.5, 2.0))
    results = json.loads(json.dumps(run_analysis(cfg)))
    fig = plane_figure(results)
    try:
        _check_figure(fig)
    finally:
        plt.close(fig)
