"""Every class a shipped config names resolves, and a checkpoint names no module of the package.

Configs name classes by dotted path (``class_path: mrl_lightning.policy.PolicyModule``); the
package's modules moved into folders (docs/architecture.md) and users' YAML files must keep
working. A checkpoint holds only weights-only-loadable values, so it never names a module of
the package and a checkpoint written before a move loads after it.
"""

from __future__ import annotations

import importlib
import re
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLASS_PATH = re.compile(r"class_path:\s*[\"']?(mrl_lightning\.[A-Za-z0-9_.]+)")


def _class_paths(value) -> list[str]:
    """Every ``class_path`` value in a parsed YAML document, at any depth."""
    found = []
    if isinstance(value, dict):
        if isinstance(value.get("class_path"), str):
            found.append(value["class_path"])
        for item in value.values():
            found += _class_paths(item)
    elif isinstance(value, list):
        for item in value:
            found += _class_paths(item)
    return found


def shipped_class_paths() -> dict[str, set[str]]:
    """class path -> the shipped files naming it: configs/, callbacks/ (parsed), docs/ and README (text)."""
    out: dict[str, set[str]] = {}
    for path in sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("callbacks/*.yaml")]):
        for doc in yaml.safe_load_all(path.read_text()):
            for name in _class_paths(doc):
                out.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for path in sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"]):
        for name in CLASS_PATH.findall(path.read_text()):
            out.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return out


def test_the_shipped_files_name_the_classes_users_configure():
    names = shipped_class_paths()
    for expected in ("mrl_lightning.policy.PolicyModule", "mrl_lightning.callbacks.SuccessGatedTransfer",
                     "mrl_lightning.rewards.ReasoningGymAccuracy", "mrl_lightning.recipes.TinyCausalLM",
                     "mrl_lightning.data.ReasoningGymDataModule", "mrl_lightning.gguf.GGUFModel"):
        assert expected in names, f"{expected} is named by no shipped config or page: the scan found {sorted(names)}"


@pytest.mark.parametrize("class_path", sorted(shipped_class_paths()))
def test_every_shipped_class_path_resolves_to_a_class(class_path):
    module_name, _, attr = class_path.rpartition(".")
    module = importlib.import_module(module_name)
    assert isinstance(getattr(module, attr, None), type), \
        f"{class_path} (named in {sorted(shipped_class_paths()[class_path])}) is not a class of {module_name}"


def test_a_checkpoint_names_no_module_of_the_package(tmp_path):
    """Its pickles reference torch and builtins only: nothing that a move of a module could break."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    from e2e_configs import write_tiny_config

    from mrl_lightning.cli import main

    config = write_tiny_config(tmp_path, modify=lambda c: c["trainer"].update(max_steps=1))
    assert main(["fit", "--config", str(config)]) == 0
    files = sorted((tmp_path / "runs").rglob("*.ckpt")) + sorted((tmp_path / "runs").rglob("*.part*"))
    pickles = []
    for file in files:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as archive:
                pickles += [(file.name, archive.read(n)) for n in archive.namelist() if n.endswith("data.pkl")]
    assert pickles, f"no torch.save pickle found among {[f.name for f in files]}"
    naming = [name for name, data in pickles if b"mrl_lightning" in data]
    assert not naming, f"these checkpoint files name a module of the package: {naming}"
