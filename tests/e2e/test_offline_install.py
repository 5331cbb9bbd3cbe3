"""An offline install that works (docs/install.md, "Offline install"); slow: downloads and a fresh venv.

``scripts/wheelhouse.py`` builds a wheelhouse for this Python and platform (torch's CPU wheel as
``.ci/run`` installs it, ``torch==2.13.0``, from this machine's disk; reasoning-gym's sdist-only
``pycosat``, ``cellpylib`` and ``zss`` built into wheels), a fresh virtual environment installs
mrl-lightning from it with ``--no-index`` and no pip configuration (the wheelhouse's own
``install.sh``), and ``mrl fit`` runs 2 steps of ``configs/default.yaml`` in it.

The run warm-starts both tiny models for 20 steps (an overlay), in a cache of its own: what is tested is
the install, not the shipped warm-starts, which a change of the data's fingerprint would send into a
full warm-start of several minutes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

QUICK_WARM_START = """\
model:
  policies:
    - class_path: mrl_lightning.policy.PolicyModule
      init_args:
        model:
          class_path: mrl_lightning.recipes.TinyCausalLM
          init_args: {warm_start_steps: 20}
    - class_path: mrl_lightning.policy.PolicyModule
      init_args:
        model:
          class_path: mrl_lightning.recipes.TinyCausalLM
          init_args: {warm_start_steps: 20}
"""


def _size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 2**20


def _run(args, timeout, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_wheelhouse_installs_with_no_index_and_mrl_fit_runs(tmp_path):
    times = {}
    start = time.monotonic()
    house = tmp_path / "wheelhouse"
    out = _run([sys.executable, str(ROOT / "scripts" / "wheelhouse.py"), str(house)], 900, cwd=ROOT)
    assert "pip install --no-index --find-links" in out.stdout
    names = {p.name.split("-")[0].lower() for p in house.glob("*.whl")}
    assert {"torch", "pycosat", "cellpylib", "zss", "reasoning_gym", "mrl_lightning"} <= names, names
    times["wheelhouse"] = time.monotonic() - start

    # the target: a fresh venv, no index, no pip configuration (this machine's find-links and index unread)
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    venv = tmp_path / "venv"
    start = time.monotonic()
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], 300, env=offline)
    _run(["sh", str(house / "install.sh")], 900, env={**offline, "PIP": str(venv / "bin" / "pip")})
    times["install"] = time.monotonic() - start
    _run([str(venv / "bin" / "python"), "-c", "import pycosat, reasoning_gym, mrl_lightning"], 300, cwd=tmp_path,
         env=offline)

    overlay = tmp_path / "quick_warm_start.yaml"
    overlay.write_text(QUICK_WARM_START)
    start = time.monotonic()
    fit = _run([str(venv / "bin" / "mrl"), "fit", "--config", "configs/default.yaml", "--config", str(overlay),
                "--trainer.max_steps", "2", "--trainer.devices", "1", "--trainer.eval_every_n_steps", "1000",
                "--trainer.checkpoint_every_n_steps", "1000", "--trainer.eval_num_generations", "0",
                "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "runs")],
               900, cwd=ROOT, env={**offline, "MRL_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    times["mrl fit"] = time.monotonic() - start
    assert "Done at step 2." in fit.stdout, fit.stdout[-3000:]
    print(f"[offline install] wheelhouse {_size_mib(house):.0f} MiB, venv {_size_mib(venv):.0f} MiB; "
          + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()))
    shutil.rmtree(venv, ignore_errors=True)
