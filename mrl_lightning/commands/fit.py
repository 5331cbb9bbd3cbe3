"""``mrl fit``: LightningCLI wired to :class:`MutualRL`, a prompt data module and :class:`MRLTrainer`.

Imported only when ``mrl fit`` runs (``mrl_lightning.cli`` keeps ``mrl --help``,
``mrl thl`` and ``mrl bandit`` free of Lightning, which takes seconds to import).
:class:`MRLTrainer` is a Fabric loop, not a ``Trainer`` subclass, so ``--print_config``,
stacked ``--config`` files, dotted overrides and ``--ckpt_path`` behave as Lightning users
expect. The resolved config is saved as ``config.yaml`` in the run folder.
"""

from __future__ import annotations

import inspect
import logging
import sys

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from mrl_lightning.config.keys import MRLArgumentParser
from mrl_lightning.config.reports import model_file_lines, replaced_setting_notes, with_config_file
from mrl_lightning.data.stream import PromptDataModule
from mrl_lightning.errors import ConfigError
from mrl_lightning.lifeline import is_launched_worker
from mrl_lightning.config.preflight import (policy_override_notes, quick_package_errors, quick_policy_errors,
                                    quick_trainer_errors, trainer_errors)
from mrl_lightning.loop.replay import REPLAY_ONLY, fresh_version, one_process, override_errors
from mrl_lightning.loop.system import MutualRL
from mrl_lightning.loop.trainer import MRLTrainer

DESCRIPTION = "Train several policies together with GRPO and experience sharing (docs/README.md)."


class MRLCLI(LightningCLI):
    """LightningCLI wired to MutualRL, a PromptDataModule subclass (``class_path``) and MRLTrainer."""

    def __init__(self, args=None, run: bool = True) -> None:
        # no "Seed set to 0" line ahead of every run's output and every config error (the seed is in config.yaml)
        logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
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
            # allow_abbrev=False: --trainer.max_step is refused, not read as --trainer.max_steps
            # (subcommand parsers copy it from the main parser; mrl_lightning.config.keys).
            parser_kwargs={"description": DESCRIPTION, "allow_abbrev": False, "fit": {"default_env": False},
                           "replay": {"default_env": False}},
            parser_class=MRLArgumentParser,  # names the nearest valid key after an unknown one
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, and ``replay`` (:mod:`mrl_lightning.loop.replay`); model and datamodule come from the config."""
        return {"fit": {"model", "datamodule"}, "replay": {"model", "datamodule"}}

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # MRLTrainer owns a Fabric; it is added without Trainer's assumptions.
        parser.add_class_arguments(MRLTrainer, "trainer", fail_untyped=False, instantiate=False, sub_configs=True)
        parser.add_lightning_class_args(MutualRL, "model")
        parser.add_lightning_class_args(PromptDataModule, "data", subclass_mode=True)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Check the trainer's own values as the arguments give them, then parse as LightningCLI does.

        A bad ``--trainer.*`` value, or a policy's own value (GRPO, sampling, engine, LoRA
        options), given in a ``--config`` file or as an override, is reported without waiting
        for the parse of the whole config (:func:`mrl_lightning.config.preflight.quick_trainer_errors`,
        :func:`~mrl_lightning.config.preflight.quick_policy_errors`), and so is every policy's missing package
        (:func:`~mrl_lightning.config.preflight.quick_package_errors`); the parsed values are checked again when the
        classes are built.

        Raises:
            ConfigError: a trainer or policy value is out of range or of the wrong kind
                (docs/reliability.md, row 46), or a policy's model needs a package not installed
                (docs/real_models.md, "Installing").
        """
        if args is None or isinstance(args, list):
            keys = set(inspect.signature(MRLTrainer.__init__).parameters) - {"self"}
            argv = list(sys.argv[1:] if args is None else args)
            if not is_launched_worker():  # the launcher says it once; before any error, which it may explain
                for note in replaced_setting_notes(argv) + policy_override_notes(argv):
                    print(note, file=sys.stderr, flush=True)
            files = model_file_lines(argv)  # before jsonargparse reads such a file's contents as the value
            if files:
                raise ConfigError("Invalid policy config:\n  - " + "\n  - ".join(files))
            errors = [with_config_file(line, argv) for line in quick_trainer_errors(argv, keys)]
            if errors:
                raise ConfigError("Invalid trainer config:\n  - " + "\n  - ".join(errors))
            errors = override_errors(argv)  # mrl replay: a policy override that reaches a policy it does not run
            if errors:
                raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))
            found = quick_policy_errors(argv)
            if found:  # worded as PolicyModule words them when it is built
                raise ConfigError(f"Invalid config for policy {found[0]!r}:\n  - " + "\n  - ".join(found[1]))
            missing = quick_package_errors(argv)  # every policy's, where building them stops at the first
            if missing:
                raise ConfigError("Missing packages of the policies' models:\n  - " + "\n  - ".join(missing))
        super().parse_arguments(parser, args)

    def instantiate_classes(self) -> None:
        """Check the trainer's own values before any class is built, then build them as LightningCLI does.

        The model and data classes are built before the trainer, and the data's may import its
        libraries (reasoning-gym: about a second); a bad ``--trainer.*`` value is reported
        without waiting for them (:func:`mrl_lightning.config.preflight.trainer_errors`). ``mrl replay``
        runs in one process, in a folder of its own: its trainer settings are replaced first, in one line each
        (:func:`mrl_lightning.loop.replay.one_process`, :func:`~mrl_lightning.loop.replay.fresh_version`).
        """
        section = self._get(self.config, "trainer")
        values = section.as_dict() if hasattr(section, "as_dict") else dict(section or {})
        if self.subcommand == "replay":  # one process (mrl_lightning.loop.replay.one_process), said in one line
            for changes, note in (one_process(values), fresh_version(values)):
                for key, value in changes.items():
                    section[key] = values[key] = value
                if note:
                    print(note, file=sys.stderr, flush=True)
        errors = trainer_errors(**values)
        if errors:
            raise ConfigError("Invalid trainer config:\n  - " + "\n  - ".join(errors))
        super().instantiate_classes()

    def _set_seed(self) -> None:
        """Seed as LightningCLI does, once ``seed_everything`` is known to be one of numpy's seeds.

        Raises:
            ConfigError: ``seed_everything`` is no integer in [0, 2**32 - 1] and not a bool (Lightning's
                ``seed_everything`` raised numpy's ValueError here, status 1).
        """
        seed = self._get(self.config, "seed_everything")
        if seed is not None and not isinstance(seed, bool) and not (isinstance(seed, int) and 0 <= seed < 2**32):
            raise ConfigError(f"Invalid config:\n  - seed_everything={seed!r} must be an integer in [0, 4294967295] (numpy's "
                              "seeds), or true for a random seed; e.g. --seed_everything 0.")
        super()._set_seed()

    def _parse_ckpt_path(self) -> None:
        """Skip LightningCLI's hyper-parameter read of ``--ckpt_path``.

        Our checkpoints hold no ``hyper_parameters`` (the config is the YAML), and
        LightningCLI's raw ``torch.load`` would crash with a bare traceback on a truncated
        file; :func:`mrl_lightning.run.checkpoint.load_checkpoint` reads and checks the file
        instead, with an error that names it.
        """

    def before_fit(self) -> None:
        """Hand the resolved config to the trainer, which saves it in the run folder (a replay's without the
        replay's own arguments: ``mrl fit --config`` reads it)."""
        config = self.config[self.subcommand].clone()
        for key in REPLAY_ONLY if self.subcommand == "replay" else ():
            config.pop(key, None)
        self.trainer.config_text = self._parser("fit").dump(config, skip_none=False)
        if self.trainer.seed is None:
            self.trainer.seed = self.config[self.subcommand].get("seed_everything")

    before_replay = before_fit
