"""The ``mrl`` command.

``mrl fit --config configs/default.yaml [--config callbacks/sgt.yaml] [--trainer.max_steps N]``
runs training through LightningCLI with :class:`MRLTrainer` (a Fabric loop, not a
``Trainer`` subclass), so ``--print_config``, stacked ``--config`` files, dotted
overrides and ``--ckpt_path`` behave as Lightning users expect. The resolved config is
saved as ``config.yaml`` in the run folder.

``mrl thl ...`` (THL alignment report) and ``mrl bandit ...`` (contextual-bandit
analysis) are plain sub-programs; ``mrl thl --help`` and ``mrl bandit --help`` say more.
"""

from __future__ import annotations

import sys
import traceback

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from mrl_lightning.data.stream import PromptDataModule
from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra.workers import WorkerError
from mrl_lightning.system import MutualRL
from mrl_lightning.trainer import MRLTrainer

USAGE = """usage: mrl {fit,thl,bandit} ...

  mrl fit --config configs/default.yaml [--config callbacks/sgt.yaml] [--trainer.max_steps N] ...
        train the policies (LightningCLI; `mrl fit --help` lists every option)
  mrl thl --source TOKENIZER --target TOKENIZER [--text-file FILE]
        THL alignment report between two tokenizers (`mrl thl --help`)
  mrl bandit --out DIR
        contextual-bandit analysis of the probes (`mrl bandit --help`)
"""


class MRLCLI(LightningCLI):
    """LightningCLI wired to MutualRL, a PromptDataModule subclass (``class_path``) and MRLTrainer."""

    def __init__(self, args=None, run: bool = True) -> None:
        super().__init__(
            model_class=MutualRL,
            datamodule_class=PromptDataModule,
            trainer_class=MRLTrainer,
            save_config_callback=None,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            seed_everything_default=0,
            args=args,
            run=run,
            parser_kwargs={"fit": {"default_env": False}},
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only ``fit`` is implemented; model and datamodule come from the config."""
        return {"fit": {"model", "datamodule"}}

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # MRLTrainer owns a Fabric; it is added without Trainer's assumptions.
        parser.add_class_arguments(MRLTrainer, "trainer", fail_untyped=False, instantiate=False, sub_configs=True)
        parser.add_lightning_class_args(MutualRL, "model")
        parser.add_lightning_class_args(PromptDataModule, "data", subclass_mode=True)

    def _parse_ckpt_path(self) -> None:
        """Skip LightningCLI's hyper-parameter read of ``--ckpt_path``.

        Our checkpoints hold no ``hyper_parameters`` (the config is the YAML), and
        LightningCLI's raw ``torch.load`` would crash with a bare traceback on a truncated
        file; :func:`mrl_lightning.checkpoint.load_checkpoint` reads and checks the file
        instead, with an error that names it.
        """

    def before_fit(self) -> None:
        """Hand the resolved config to the trainer, which saves it in the run folder."""
        self.trainer.config_text = self._parser("fit").dump(self.config["fit"], skip_none=False)
        if self.trainer.seed is None:
            self.trainer.seed = self.config["fit"].get("seed_everything")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mrl``."""
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "thl":
        from mrl_lightning.thl.cli import main as thl_main

        return thl_main(argv[1:])
    if argv and argv[0] == "bandit":
        from mrl_lightning.analysis.cli import main as bandit_main

        return bandit_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        if not argv:
            return 2
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
