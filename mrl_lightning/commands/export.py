"""``mrl export``: a trained policy of a run as a folder ``from_pretrained`` loads (docs/mwra.md, "Memory per policy").

``mrl export --run runs/default/version_0 --policy gpt2 --out exported/gpt2`` rebuilds the
policy from the run's ``config.yaml`` (its recipe's cached folder, hub id or local folder),
loads its weights from the run's checkpoint (``last.ckpt``, or ``--ckpt_path``), merges a
LoRA adapter into the base weights (``peft``'s ``merge_and_unload``) and writes the model
and tokenizer with ``save_pretrained``. The folder then loads with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``, in this
project (``model: exported/gpt2``) or anywhere else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mrl_lightning.errors import ConfigError
from mrl_lightning.writable import write_problem


def export_policy(run: str | Path, policy_name: str, out: str | Path, ckpt_path: str | Path | None = None) -> Path:
    """Write ``policy_name`` of ``run`` as a ``save_pretrained`` folder (model + tokenizer).

    Args:
        run: A run folder (``<default_root_dir>/version_<n>``) holding ``config.yaml``.
        policy_name: The policy's ``name``.
        out: The folder to write (created; it must not hold files already).
        ckpt_path: The checkpoint to take the weights from; None = ``<run>/checkpoints/last.ckpt``.

    Returns:
        ``out``.

    Raises:
        ConfigError: no ``config.yaml`` in ``run``, an unknown policy name, ``out`` not empty or not writable.
        CheckpointError: the checkpoint is missing, unreadable, or does not fit the policy.
    """
    from mrl_lightning.builders import build_policy
    from mrl_lightning.run.checkpoint import CheckpointError, load_checkpoint
    run, out = Path(run).expanduser(), Path(out).expanduser()
    config = run / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"--run {str(run)!r} holds no config.yaml; give a run folder such as "
                          "runs/default/version_0 (the folder mrl fit printed as 'Run folder').")
    if out.exists() and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {str(out)!r} is not empty; give a new folder.")
    problem = write_problem(out)
    if problem is not None:
        raise ConfigError(f"--out {str(out)!r} cannot be written ({problem}); give a folder you can write.")
    state = load_checkpoint(ckpt_path or run / "checkpoints" / "last.ckpt", policies=[policy_name])
    cli = build_only(config)
    if policy_name not in cli.model.policies:
        raise ConfigError(f"--policy {policy_name!r} is not a policy of this run; its policies: "
                          f"{list(cli.model.policies)}.")
    policy = cli.model.policies[policy_name]
    cli.datamodule.setup("fit")
    build_policy(policy, cli.datamodule, cache_log=lambda _msg: None)
    try:
        policy.load_weights_state_dict(state["policies"][policy_name]["model"])
    except (KeyError, RuntimeError) as exc:
        raise CheckpointError(f"the checkpoint's weights of policy {policy_name!r} do not fit the run's config "
                              f"({str(exc).splitlines()[0]}).") from exc
    model = policy.model.merge_and_unload() if policy.is_adapter else policy.model
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    policy.tokenizer.save_pretrained(str(out))
    return out


def build_only(config: Path):
    """The run's objects (``MRLCLI(run=False)``: ``.model``, ``.datamodule``) from its ``config.yaml``, built
    without ``fit``'s own keys (``ckpt_path``), which a parser that only builds does not take."""
    import tempfile

    import yaml

    from mrl_lightning.commands.fit import MRLCLI

    values = yaml.safe_load(Path(config).read_text())
    values.pop("ckpt_path", None)
    with tempfile.TemporaryDirectory(prefix="mrl_export_") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(values))
        return MRLCLI(args=["--config", str(path)], run=False)


def main(argv: list[str]) -> int:
    """``mrl export``; returns the exit status (2 for bad input)."""
    parser = argparse.ArgumentParser(prog="mrl export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="run folder holding config.yaml (e.g. runs/default/version_0)")
    parser.add_argument("--policy", required=True, help="the policy's name")
    parser.add_argument("--out", required=True, help="folder to write (new or empty)")
    parser.add_argument("--ckpt_path", default=None, help="checkpoint to take the weights from (default: last.ckpt)")
    args = parser.parse_args(argv)
    try:
        out = export_policy(args.run, args.policy, args.out, args.ckpt_path)
    except ConfigError as exc:
        print(f"mrl export: {exc}", file=sys.stderr)
        return 2
    print(f"Wrote {out} (load it with AutoModelForCausalLM.from_pretrained({str(out)!r})).")
    return 0
