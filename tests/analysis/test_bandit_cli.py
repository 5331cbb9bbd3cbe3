"""``mrl bandit`` end to end: files written, settings checked, results deterministic (docs/bandit.md)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from mrl_lightning.analysis.cli import main
from mrl_lightning.analysis.config import BanditConfig
from mrl_lightning.analysis.simulate import run_analysis

TINY = ["--contexts", "8", "--actions", "4", "--steps", "6", "--replicas", "2", "--mc-draws", "50",
        "--checkpoints", "2", "--group-size", "4", "--peer-samples", "4"]
FILES = ("bandit_results.json", "bandit_probes.csv", "bandit_curves.csv", "stability_support.png",
         "success_over_training.png")


def test_cli_writes_json_csv_and_png(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "out"), "--seed", "3", *TINY]) == 0
    out = tmp_path / "out"
    for name in FILES:
        assert (out / name).stat().st_size > 0, name
    for png in FILES[3:]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "bandit_results.json").read_text())
    names = [p["name"] for p in data["probes"]]
    assert names == ["none", "prp-truncate", "prp-clip", "prp-none", "xgrpo", "sgt", "sgt@0.5"]
    assert data["config"]["seed"] == 3 and data["config"]["num_contexts"] == 8
    rows = list(csv.DictReader((out / "bandit_probes.csv").open()))
    assert [r["probe"] for r in rows] == names
    assert {r["is_mode"] for r in rows if r["kind"] == "prp"} == {"truncate", "clip", "none"}
    curves = list(csv.DictReader((out / "bandit_curves.csv").open()))
    assert len(curves) == len(names) * 2 * 2 * (6 + 1)  # probes x families x halves x steps
    printed = capsys.readouterr().out
    assert "prp-truncate" in printed and str(out / "stability_support.png") in printed


def test_cli_probe_subset_and_no_extra_sgt(tmp_path):
    assert main(["--out", str(tmp_path), *TINY, "--probes", "none", "sgt", "--sgt-extra-lambdas", "--quiet"]) == 0
    data = json.loads((tmp_path / "bandit_results.json").read_text())
    assert [p["name"] for p in data["probes"]] == ["none", "sgt"]


def test_cli_rejects_bad_settings_with_argument_and_fix(tmp_path, capsys):
    code = main(["--out", str(tmp_path), "--contexts", "7", "--residual", "1.5", "--probes", "ppo"])
    assert code == 2
    err = capsys.readouterr().err
    assert "num_contexts=7" in err and "even" in err
    assert "residual=1.5" in err and "[0, 1]" in err
    assert "probes=" in err and "prp-clip" in err
    assert not (tmp_path / "bandit_results.json").exists()


def test_cli_runs_as_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mrl_lightning.analysis.cli", "--out", str(tmp_path), *TINY,
         "--probes", "none", "--sgt-extra-lambdas", "--quiet"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bandit_probes.csv").exists()


@pytest.fixture(scope="module")
def tiny_cfg() -> BanditConfig:
    return BanditConfig(num_contexts=8, num_actions=4, group_size=4, peer_samples=4, steps=6, replicas=2,
                        mc_draws=50, checkpoints=2, seed=11)


def test_same_seed_gives_identical_results(tiny_cfg):
    assert json.dumps(run_analysis(tiny_cfg)) == json.dumps(run_analysis(tiny_cfg))


def test_other_seed_gives_other_results(tiny_cfg):
    other = BanditConfig(**{**vars(tiny_cfg), "seed": 12})
    assert run_analysis(tiny_cfg)["probes"][0]["init"] != run_analysis(other)["probes"][0]["init"]


def test_an_out_folder_that_cannot_be_made_is_one_line_before_the_work(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr("mrl_lightning.analysis.simulate.run_analysis",
                        lambda cfg: pytest.fail("the analysis ran before --out was checked"))
    assert main(["--out", str(tmp_path / "afile" / "sub"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "afile/sub cannot be created" in err[0] and "Traceback" not in err[0]
