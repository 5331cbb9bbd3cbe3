"""The ``mrl`` command.

``mrl fit --config configs/default.yaml [--config callbacks/sgt.yaml] [--trainer.max_steps N]``
runs training through LightningCLI (:class:`mrl_lightning.fit_cli.MRLCLI`); ``mrl fit
--help`` lists every option. ``mrl thl ...`` (THL alignment report, ``docs/thl.md``) and
``mrl bandit ...`` (contextual-bandit analysis, ``docs/bandit.md``) and ``mrl export ...`` (a
trained policy as a ``save_pretrained`` folder, :mod:`mrl_lightning.export`) are plain sub-programs.

Start-up: this module imports nothing heavy. Lightning, torch and the models are imported
only by the sub-command that needs them, so ``mrl --help`` answers at once and ``mrl thl``
/ ``mrl bandit`` never import Lightning.
"""

from __future__ import annotations

import sys
import traceback

from mrl_lightning.errors import ConfigError

USAGE = """usage: mrl {fit,export,thl,bandit} ...

  mrl fit --config configs/default.yaml [--config callbacks/sgt.yaml] [--trainer.max_steps N] ...
        train the policies (LightningCLI; `mrl fit --help` lists every option)
  mrl export --run runs/default/version_0 --policy gpt2 --out DIR
        a trained policy (LoRA merged) as a save_pretrained folder (`mrl export --help`)
  mrl thl --source TOKENIZER --target TOKENIZER [--text-file FILE]
        THL alignment report between two tokenizers (`mrl thl --help`)
  mrl bandit --out DIR
        contextual-bandit analysis of the probes (`mrl bandit --help`)

Documentation: docs/README.md
"""


def __getattr__(name: str):
    """``mrl_lightning.cli.MRLCLI``, imported on first use (it pulls in Lightning)."""
    if name == "MRLCLI":
        from mrl_lightning.fit_cli import MRLCLI

        return MRLCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mrl``.

    Args:
        argv: Arguments after ``mrl`` (``None`` = ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success (``mrl --help`` included), 1 on a worker error, 2 on
        a configuration error or no sub-command (the usage then goes to stderr).
    """
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "thl":
        from mrl_lightning.thl.cli import main as thl_main

        return thl_main(argv[1:])
    if argv and argv[0] == "export":
        from mrl_lightning.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "bandit":
        from mrl_lightning.analysis.cli import main as bandit_main

        return bandit_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from mrl_lightning.fit_cli import MRLCLI
    from mrl_lightning.mwra.workers import WorkerError

    try:
        MRLCLI(args=None if from_shell else argv)
    except WorkerError as exc:
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
        print(f"mrl: worker error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - a ConfigError may arrive wrapped by jsonargparse
        config_error = _find_config_error(exc)
        if config_error is None and _from_config_parsing(exc):
            config_error = exc  # jsonargparse folds nested ConfigErrors into a Union message
        if config_error is None:
            raise
        print(f"mrl: configuration error:\n{config_error}", file=sys.stderr)
        return 2
    return 0


def _from_config_parsing(exc: BaseException) -> bool:
    """True for jsonargparse's "does not validate" errors raised while instantiating the config."""
    return isinstance(exc, ValueError) and "Does not validate against any of the Union subtypes" in str(exc)


def _find_config_error(exc: BaseException | None) -> ConfigError | None:
    """The ConfigError in ``exc``'s cause/context chain, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
