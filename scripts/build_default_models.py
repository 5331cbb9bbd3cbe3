"""Rebuild the warm-started models the embedded default ships (``models/default/<policy>``), with its own recipe.

The default's two tiny policies are warm-started by :class:`~mrl_lightning.recipes.TinyCausalLM`
(minutes on a CPU). A warm-start rebuilt on another CPU ends elsewhere (float rounding of
thousands of supervised steps: one machine's Llama stopped at 0.69 validation accuracy,
another's at 0.70, and their RL runs started 0.52 and 0.60 apart on the strong part), so the
repository ships the folders, and ``configs/default.yaml`` points each recipe's ``prebuilt`` at
them: a run then starts from the same weights on every machine, and a changed recipe,
template or data config still builds its own (docs/default.md).

Usage (from the repository root; writes ``models/default/gpt2`` and ``models/default/llama``)::

    python scripts/build_default_models.py [--config configs/default.yaml] [--out models/default]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "default.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "models" / "default")
    args = parser.parse_args(argv)

    from mrl_lightning.builders import materialize
    from mrl_lightning.commands.export import build_only
    from mrl_lightning.model.source import ModelRecipe

    cli = build_only(args.config)
    cli.datamodule.setup("fit")
    with tempfile.TemporaryDirectory(prefix="mrl_default_models_") as cache:
        for name, policy in cli.model.policies.items():
            recipe = policy.model_source
            if not isinstance(recipe, ModelRecipe):
                continue
            recipe.cache_dir, recipe.prebuilt = cache, None  # a fresh build, not the shipped copy
            folder = Path(materialize(policy, cli.datamodule, cache_log=print))
            target = args.out / name
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(folder, target)
            print(f"[{name}] wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
