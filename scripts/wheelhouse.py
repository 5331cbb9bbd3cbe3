#!/usr/bin/env python3
"""Build a wheelhouse for an offline install of mrl-lightning (docs/install.md, "Offline install").

On a connected machine:

    python scripts/wheelhouse.py WHEELHOUSE [--extras dev] [--torch torch==2.13.0]
        [--python-version 3.11 --platform manylinux_2_28_x86_64 ...]     # a foreign target

then carry WHEELHOUSE to the target and run the one command it prints (also written to
WHEELHOUSE/install.sh, which finds the wheelhouse beside itself):

    pip install --no-index --find-links WHEELHOUSE 'mrl-lightning[dev]'

What goes in:

1. the project's own wheel (pure Python: any platform);
2. the sdist-only packages reasoning-gym needs (``pycosat``, a C extension, ``cellpylib``, ``zss``:
   PyPI has no wheel of them, and ``import reasoning_gym`` imports pycosat), downloaded as sdists into
   ``WHEELHOUSE/sdist/`` and built into wheels here with ``pip wheel --no-deps --no-build-isolation``.
   For a foreign target (``--platform`` / ``--python-version`` given) only the pure-Python ones
   (``py3-none-any``) are kept; a C one must be built on the target, from the carried sdist, with
   the command printed (it needs a C compiler there; setuptools and wheel come from the wheelhouse);
3. every other dependency, resolved for the target by ``pip download --only-binary=:all:``:
   the project's requirements (its ``[extras]`` included) with reasoning-gym replaced by its own
   requirements minus the sdist-only ones, plus those ones' own requirements; reasoning-gym itself
   with ``--no-deps``; torch as ``--torch`` gives it (this project's machines find the CPU wheel of
   2.13.0 on disk; elsewhere pass ``--index-url https://download.pytorch.org/whl/cpu`` through
   ``--pip-arg`` for a CPU torch); setuptools and wheel (build isolation on the target).

With no ``--platform`` / ``--python-version`` the target is this interpreter and platform (pip's
own tags). The pip that runs is ``python -m pip`` of the interpreter running this script, with its
configuration (index, find-links): the wheelhouse is where the downloads are, the install on the
target reads nothing else.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# reasoning-gym 0.1.25's exact pins of its sdist-only requirements (zss: its minimum)
SDIST_ONLY = ["pycosat==0.6.6", "cellpylib==2.4.0", "zss==1.2.0"]
TORCH = "torch==2.13.0"


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", shlex.join(cmd), flush=True)
    done = subprocess.run(cmd)
    if check and done.returncode:
        raise SystemExit(f"error: pip exited with {done.returncode} (its message is above); the wheelhouse is "
                         "incomplete. A requirement with no wheel for the target: add it to --sdist-only.")
    return done


def name_of(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def wheel_requires(wheel: Path, extras: set[str] = frozenset()) -> list[str]:
    """A wheel's ``Requires-Dist``, those of ``extras`` included (their ``extra ==`` marker dropped; the
    project's and reasoning-gym's requirements carry no other markers, which are passed through as written)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode("utf-8").splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line.split(":", 1)[1].strip().partition(";")
        found = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if found:
            if found.group(1) in extras:
                out.append(spec.strip())
        else:
            out.append(line.split(":", 1)[1].strip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheelhouse", type=Path)
    ap.add_argument("--extras", default="", help="comma-separated extras of mrl-lightning, e.g. dev")
    ap.add_argument("--torch", default=TORCH, help=f"torch requirement (default {TORCH})")
    ap.add_argument("--python-version", help="target Python, e.g. 3.12 (default: this interpreter)")
    ap.add_argument("--platform", action="append", default=[],
                    help="target platform tag, repeatable, e.g. manylinux_2_28_x86_64 (default: this machine)")
    ap.add_argument("--sdist-only", nargs="*", default=SDIST_ONLY, help=f"default: {' '.join(SDIST_ONLY)}")
    ap.add_argument("--pip-arg", action="append", default=[], help="passed to every pip download, e.g. --index-url=URL")
    args = ap.parse_args(argv)
    start = time.monotonic()
    out = args.wheelhouse.resolve()
    sdists = out / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    extras = {e.strip() for e in args.extras.split(",") if e.strip()}
    foreign = bool(args.platform or args.python_version)
    target = (["--python-version", args.python_version] if args.python_version else []) + [
        x for p in args.platform for x in ("--platform", p)]
    if foreign and not args.platform:
        target += ["--implementation", "cp"]
    extra = list(args.pip_arg)

    # 1. the project's own wheel
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT))
    project = max(out.glob("mrl_lightning-*.whl"), key=lambda p: p.stat().st_mtime)

    # 2. the sdist-only packages: sdists carried, wheels built here (all of them for this machine, the pure
    #    ones for a foreign target)
    pip("download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(sdists), *extra, *args.sdist_only)
    skip = {name_of(s) for s in args.sdist_only}
    built_reqs: list[str] = []
    on_target: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        for sdist in sorted(sdists.iterdir()):
            if name_of(sdist.name.rsplit("-", 1)[0]) not in skip:
                continue
            done = pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, str(sdist), check=False)
            wheels = [w for w in Path(tmp).glob("*.whl") if name_of(w.name.split("-")[0]) == name_of(
                sdist.name.rsplit("-", 1)[0])]
            if done.returncode or not wheels:
                if not foreign:
                    print(f"error: could not build {sdist.name} here (a C compiler and setuptools are needed)")
                    return 1
                on_target.append(sdist)
                continue
            wheel = wheels[0]
            built_reqs += wheel_requires(wheel)
            if foreign and not wheel.name.endswith("-none-any.whl"):
                on_target.append(sdist)  # built for this machine, not the target
            else:
                shutil.copy2(wheel, out / wheel.name)
            wheel.unlink()

    # 3. reasoning-gym's wheel alone, then everything else resolved for the target from wheels only
    project_reqs = wheel_requires(project, extras)
    gym = [r for r in project_reqs if name_of(r) == "reasoning-gym"]
    reqs = [r for r in project_reqs if name_of(r) != "reasoning-gym"]
    if gym:
        pip("download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(out), *target, *extra, *gym)
        gym_wheel = max(out.glob("reasoning_gym-*.whl"), key=lambda p: p.stat().st_mtime)
        reqs += [r for r in wheel_requires(gym_wheel) if name_of(r) not in skip]
    reqs += [r for r in built_reqs if name_of(r) not in skip]
    pip("download", "--only-binary=:all:", "-q", "-d", str(out), *target, *extra,
        args.torch, *reqs, "setuptools>=68", "wheel")

    spec = f"mrl-lightning[{','.join(sorted(extras))}]" if extras else "mrl-lightning"
    commands = [f'$PIP wheel --no-index --find-links "$WHEELHOUSE" --no-deps -w "$WHEELHOUSE" "$WHEELHOUSE/sdist/{s.name}"'
                for s in on_target]  # C extensions: built on the target (a compiler there; setuptools from here)
    commands.append(f"$PIP install --no-index --find-links \"$WHEELHOUSE\" '{spec}'")
    script = out / "install.sh"
    script.write_text("#!/bin/sh\n"
                      f"# {spec} from this wheelhouse, no index: sh install.sh (PIP=/path/to/venv/bin/pip to choose the pip)\n"
                      f"# target: {shlex.join(target) if foreign else 'the machine that built it'}\n"
                      'set -e\nWHEELHOUSE=$(cd "$(dirname "$0")" && pwd)\nPIP=${PIP:-pip}\n' + "\n".join(commands) + "\n")
    script.chmod(0o755)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wheelhouse {out}: {len(list(out.glob('*.whl')))} wheels, {len(list(sdists.iterdir()))} sdists, "
          f"{size / 2**20:.0f} MiB, {time.monotonic() - start:.0f} s")
    print(f"on the target: sh {out.name}/install.sh, i.e.\n  " + "\n  ".join(
        c.replace("$PIP", "pip").replace('"$WHEELHOUSE"', out.name).replace("$WHEELHOUSE", out.name)
        for c in commands))
    return 0


if __name__ == "__main__":
    sys.exit(main())
