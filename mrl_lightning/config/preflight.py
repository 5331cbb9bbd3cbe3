"""Config time: what a run checks before it builds or warm-starts any model (docs/reliability.md).

:func:`check_before_build` runs first in :meth:`MRLTrainer.fit <mrl_lightning.loop.trainer.MRLTrainer.fit>`, on
every rank, before the workers are launched. Each problem is a :class:`~mrl_lightning.errors.ConfigError` (or a
:class:`~mrl_lightning.run.checkpoint.CheckpointError`) naming the field, the value and the fix,
so ``mrl fit`` stops with status 2 within seconds instead of minutes into a warm-start or
after every rank has built its models:

1. the placement of policies on ranks (:func:`~mrl_lightning.mwra.build_placement`);
2. the services callbacks need, probes sharing with nobody or naming no policy (:func:`sharing_errors`), then
   each callback's own checks;
3. ``strong_parts`` among the data parts (:func:`part_errors`), each recipe's checks against the data (``warm_start_part``
   among the data parts, a cache it can write when its model is not built yet: :meth:`ModelRecipe.config_errors
   <mrl_lightning.model.source.ModelRecipe.config_errors>`) and each policy's model config
   counted on the meta device (LoRA target modules);
4. ``--ckpt_path``: readable, of this code's format, and of this config: policy names,
   data parts, each policy's family, kind (full / LoRA) and parameter shapes
   (:func:`~mrl_lightning.run.checkpoint.check_compatible`);
5. a ``cost`` placement chosen by predicted step (:func:`~mrl_lightning.mwra.cost.place_by_cost`; the callbacks'
   checks again when it changed the placement, and each policy's group against its sharding), then the MWRA
   resource plan (devices, workers against cores, threads, memory: :func:`~mrl_lightning.mwra.plan.plan_resources`);
6. on rank 0, the run folder: not already holding a run, and writable.

Earlier still, when the trainer is made: its own values (:func:`trainer_errors`, which
``mrl fit`` also runs before it builds any class of the config, so a bad ``--trainer.*``
value is reported without importing the data's libraries) and its Fabric (:func:`make_fabric`: an
accelerator this machine does not have, a precision Lightning would silently run as another).
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any

from lightning.fabric import Fabric

from mrl_lightning.builders import plan_shapes
from mrl_lightning.callbacks.base import service_errors, sharing_errors
from mrl_lightning.run.checkpoint import check_compatible, checkpoint_policies, load_checkpoint
from mrl_lightning.config.keys import parsed_file_naming
from mrl_lightning.errors import ConfigError
from mrl_lightning.model.source import ModelRecipe
from mrl_lightning.mwra import PLACEMENTS, Placement, build_placement
from mrl_lightning.mwra.cost import place_by_cost
from mrl_lightning.mwra.plan import eval_prompts, plan_resources
from mrl_lightning.mwra.sharding import sharding_errors
from mrl_lightning.mwra.strategy import PolicyGroupsStrategy
from mrl_lightning.policy.checks import package_errors, part_errors
from mrl_lightning.policy.prompt_fit import prompt_errors
from mrl_lightning.run.state import check_run_folder

STRATEGIES = ("auto", "ddp")
UNIFIED_PRECISION = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


def trainer_errors(*, max_steps: int = 1000, log_every_n_steps: int = 10, eval_every_n_steps: int = 100,
                   keep_checkpoints: int = 2, devices: int = 1, num_nodes: int = 1, eval_num_generations: int = 8,
                   checkpoint_every_n_steps: int = 500, num_threads: int | None = None, strategy: str = "auto",
                   placement: str = "auto", collective_timeout_s: float = 1800.0, accelerator: str = "auto",
                   version: int | str | None = None, num_sample_completions: int = 4, max_lag: int = 0,
                   **_: Any) -> list[str]:
    """Problems of :class:`~mrl_lightning.loop.trainer.MRLTrainer`'s own values (its defaults here too), all at once.

    Needs nothing built: ``mrl fit`` runs it on the parsed ``trainer`` section before it
    instantiates any class of the config (:meth:`MRLCLI.instantiate_classes
    <mrl_lightning.commands.fit.MRLCLI.instantiate_classes>`). Other keywords are ignored.
    """
    errors = []
    for key, value in (("max_steps", max_steps), ("log_every_n_steps", log_every_n_steps),
                       ("eval_every_n_steps", eval_every_n_steps), ("keep_checkpoints", keep_checkpoints),
                       ("devices", devices), ("num_nodes", num_nodes), ("max_lag", max_lag)):
        low, zero = {"eval_every_n_steps": (0, " (0 = no evaluation)"), "max_lag": (0, " (0 = lockstep)")}.get(key, (1, ""))
        if not isinstance(value, int) or value < low:
            errors.append(f"trainer.{key}={value!r} must be an integer >= {low}{zero}; e.g. --trainer.{key} {low + 1}.")
    for key, value, zero in (("num_sample_completions", num_sample_completions, " (0 = no completions logged as text)"),
                             ("eval_num_generations", eval_num_generations, " (0 = greedy only)"),
                             ("checkpoint_every_n_steps", checkpoint_every_n_steps, "")):
        if value < 0:
            errors.append(f"trainer.{key}={value} must be >= 0{zero}.")
    if num_threads is not None and num_threads < 1:
        errors.append(f"trainer.num_threads={num_threads} must be >= 1 or null.")
    if strategy not in STRATEGIES:
        errors.append(f"trainer.strategy={strategy!r} is not supported: each policy's data parallelism runs over "
                      f"its own group of ranks (docs/mwra.md); valid: {list(STRATEGIES)}.")
    if placement not in PLACEMENTS:
        errors.append(f"trainer.placement={placement!r}; valid: {list(PLACEMENTS)}.")
    if not collective_timeout_s > 0:
        errors.append(f"trainer.collective_timeout_s={collective_timeout_s} must be > 0 seconds.")
    if isinstance(version, str) and (version.strip() in ("", ".", "..") or "/" in version or "\\" in version):
        errors.append(f"trainer.version={version!r} must be a plain folder name (no '/', not '.' or '..'): the run "
                      "folder is <default_root_dir>/<version>; e.g. --trainer.version seed0 (unset: version_<n>).")
    errors.extend(accelerator_errors(accelerator))
    return errors


def _read_argv(argv: list[str]) -> list[tuple[str, Any]] | None:
    """``mrl fit``'s arguments as what they set, in their order: ``("config", mapping)`` for each
    ``--config`` file read as YAML, ``(dotted_key, value)`` for each ``--<key> <value>`` override.

    None when the reading is not sure of them: ``--help``, ``--print_config``, a section given
    whole (``--trainer``, ``--model``), a config that is no readable YAML mapping (not UTF-8
    included: the parser names the file and the byte, :func:`mrl_lightning.config.keys.config_file_problems`).
    """
    import yaml

    args = argv[1:] if argv[:1] in (["fit"], ["replay"]) else list(argv)
    events: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name in ("-h", "--help", "--trainer", "--model", "--data") or name.startswith("--print_config"):
            return None
        has_value = bool(eq) or (i + 1 < len(args) and not args[i + 1].startswith("--"))
        value = inline if eq else (args[i + 1] if has_value else None)
        i += 1 if eq or not has_value else 2
        if value is None:
            continue
        try:
            if name in ("-c", "--config"):
                with open(value, encoding="utf-8") as fh:
                    loaded = yaml.safe_load(fh)
                if not isinstance(loaded, dict):
                    return None
                events.append(("config", loaded))
            elif name.startswith("--"):  # --model.policies.<key> is --model.policies.init_args.<key> to the parser
                key = re.sub(r"^model\.policies\.(?!init_args\.|class_path$|help$|dict_kwargs\.)", _OVERRIDE, name[2:])
                events.append((key, yaml.safe_load(value)))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return None
    return events


def quick_trainer_errors(argv: list[str], keys: set[str]) -> list[str]:
    """:func:`trainer_errors` of the ``trainer`` values read straight from ``mrl fit``'s arguments.

    Before LightningCLI parses a config (about 1.5 s on this machine's default config, several
    times the cost of ``--help``), the ``trainer`` sections of the ``--config`` files and the
    ``--trainer.<key> <value>`` overrides are merged in their order (later wins, as in
    jsonargparse), each value read as YAML as jsonargparse reads it; the known scalar keys
    go to :func:`trainer_errors`. Anything this reading is not sure of (a ``--trainer``
    given whole, a config that is no readable YAML mapping, ``--print_config``, ``--help``,
    a value of another type) is left to the full parse, which reports it: this finds a
    subset of its errors sooner, never one it would not find.

    Args:
        argv: The arguments after ``mrl`` (``fit`` first, or not).
        keys: The trainer's argument names (``MRLTrainer.__init__``'s).

    Returns:
        The problems, as :func:`trainer_errors` words them; [] when none was found or the
        arguments are beyond this reading.
    """
    events = _read_argv(argv)
    if events is None:
        return []
    values: dict[str, Any] = {}
    for key, value in events:
        if key == "config":
            section = value.get("trainer")
            if section is not None and not isinstance(section, dict):
                return []
            values.update(section or {})
        elif key.startswith("trainer."):
            values[key[len("trainer."):]] = value
    known = {k: v for k, v in values.items() if k in keys and (v is None or isinstance(v, (bool, int, float, str)))}
    try:
        return trainer_errors(**known)
    except TypeError:  # a value of another type: the full parse names it
        return []


_OVERRIDE = "model.policies.init_args."


def quick_policy_errors(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(name, errors)`` of the first policy with :func:`~mrl_lightning.policy.checks.option_errors`, from values
    read straight from ``mrl fit``'s arguments; None when none has any.

    The ``model.policies`` list of the last ``--config`` file that has one (a later list replaces an earlier one,
    as in jsonargparse) with the ``--model.policies.init_args.<key> <value>`` overrides applied to its last entry
    (where jsonargparse applies them), each :class:`~mrl_lightning.policy.PolicyModule` entry filled with the
    class's defaults. Only checks that need no model or tokenizer run; an entry of another class, a value of
    another type than its default's, or another ``--model.policies...`` argument is left to the full parse
    (which then finds the same error, with the model and tokenizer checks after it).
    """
    import inspect
    from types import SimpleNamespace

    from mrl_lightning.policy.module import PolicyModule
    from mrl_lightning.policy.checks import option_errors

    policies = _policy_entries(argv)
    if policies is None:
        return None
    defaults = {n: p.default for n, p in inspect.signature(PolicyModule.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    for entry in policies or []:
        if str(entry.get("class_path", "")).rsplit(".", 1)[-1] != "PolicyModule":
            return None
        given = entry["init_args"]
        if not isinstance(given.get("name"), str) or set(given) - set(defaults) - {"name", "model"}:
            return None
        values = dict(defaults)
        for key, value in given.items():
            default = defaults.get(key)
            if isinstance(default, float) and isinstance(value, (int, str)) and not isinstance(value, bool):
                try:
                    value = float(value)  # YAML reads 1e-3 as a string; jsonargparse as the float it is
                except ValueError:
                    return None
            if default is not None and key != "model" and type(value) is not type(default) and value is not None:
                return None
            values[key] = value
        values["policy_name"] = values.pop("name")
        try:
            errors = option_errors(SimpleNamespace(**values))
        except (TypeError, ValueError, AttributeError):
            return None
        if errors:
            return values["policy_name"], errors
    return None


def _policy_entries(argv: list[str]) -> list[dict] | None:
    """The ``model.policies`` entries :func:`quick_policy_errors` reads ([] for none; None when not sure)."""
    events, policies = _read_argv(argv), []
    for key, value in events or []:
        if key == "config" and isinstance(value.get("model"), dict) and "policies" in value["model"]:
            policies = value["model"]["policies"]
            if not isinstance(policies, list) or not all(isinstance(e, dict) for e in policies):
                return None
            policies = [{**e, "init_args": dict(e.get("init_args") or {})} for e in policies]
        elif key.startswith(_OVERRIDE) and "." not in key[len(_OVERRIDE):] and policies:
            policies[-1]["init_args"][key[len(_OVERRIDE):]] = value
        elif key.startswith("model.policies"):
            return None
    return None if events is None else policies


def quick_package_errors(argv: list[str]) -> list[str]:
    """Every policy's :func:`~mrl_lightning.policy.checks.package_errors` (the parse stopped at the first)."""
    return package_errors([(e["init_args"].get("name"), e["init_args"].get("model"))
                           for e in _policy_entries(argv) or []])


def policy_override_notes(argv: list[str]) -> list[str]:
    """A note for each ``--model.policies.init_args.<key>`` override given with a list of several policies.

    jsonargparse applies such an override to the list's last entry only; a user who meant every
    policy would not know. Returns [] when there is one policy or the reading is not sure.
    """
    events = _read_argv(argv)
    if events is None:
        return []
    from mrl_lightning.config.keys import init_arg_names

    names, notes, last_class = None, [], None
    for key, value in events:
        if key == "config" and isinstance(value.get("model"), dict) and "policies" in value["model"]:
            entries = value["model"]["policies"]
            names = ([(e.get("init_args") or {}).get("name") for e in entries if isinstance(e, dict)]
                     if isinstance(entries, list) else None)
            last_class = entries[-1].get("class_path") if isinstance(entries, list) and entries \
                and isinstance(entries[-1], dict) else None
        elif key.startswith(_OVERRIDE) and names and len(names) > 1:
            valid = init_arg_names(last_class or "mrl_lightning.policy.PolicyModule")
            if valid and key[len(_OVERRIDE):].split(".")[0] not in valid:
                continue  # a key the class does not take: the parser's error says so, a note would mislead
            notes.append(f"note: --model.policies.{key[len(_OVERRIDE):]} applies to the last policy of the list only ({names[-1]!r}; "
                         f"the others, {names[:-1]}, keep their value). To change another policy, or every "
                         "one, copy the config and edit its policies.")
    return notes


def accelerator_errors(accelerator: str) -> list[str]:
    """``trainer.accelerator`` naming a device this machine does not have (Lightning's own error names no field)."""
    import torch

    name = str(accelerator).lower()
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    missing = None
    if name in ("cuda", "gpu") and not cuda and not (name == "gpu" and mps):
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        missing = f"no CUDA GPU is visible here (torch {torch.__version__}, {built})"
    elif name == "mps" and not mps:
        missing = "no Apple MPS device is available here"
    return [] if missing is None else [f"trainer.accelerator={accelerator!r} but {missing}. Use --trainer.accelerator "
                                       "cpu, or auto (a GPU when there is one, else the CPU)."]


def make_fabric(strategy: str, collective_timeout_s: float, **kwargs: Any) -> Fabric:
    """The trainer's Fabric: one process, or :class:`~mrl_lightning.mwra.strategy.PolicyGroupsStrategy`.

    Args:
        strategy: ``trainer.strategy`` ("auto" or "ddp").
        collective_timeout_s: ``trainer.collective_timeout_s``.
        **kwargs: ``accelerator``, ``devices``, ``num_nodes``, ``precision``, ``callbacks``, ``loggers``.

    Raises:
        ConfigError: Lightning refuses the settings (its message, with the fields), or would run another
            precision than ``trainer.precision`` on this accelerator (e.g. ``16-mixed`` on a CPU, which
            Lightning turns into ``bf16-mixed`` with a warning only).
    """
    fields = ", ".join(f"trainer.{k}={kwargs.get(k)!r}" for k in ("accelerator", "devices", "num_nodes", "precision"))
    from lightning_utilities.core import rank_zero

    info = rank_zero.log  # where Lightning's rank_zero_info lines go ("Using bfloat16 ..."; set by lightning.pytorch)
    held: list[logging.LogRecord] = []
    hold = _Hold(held)
    info.addFilter(hold)
    try:
        with warnings.catch_warnings(record=True) as said:  # replayed below unless refused (a switched precision)
            warnings.simplefilter("always")
            fabric = Fabric(strategy="auto" if strategy == "auto" else "ddp", **kwargs)
            if fabric.world_size > 1 or strategy == "ddp":
                fabric = Fabric(strategy=PolicyGroupsStrategy(timeout_s=collective_timeout_s), **kwargs)
    except Exception as exc:  # noqa: BLE001 - Lightning refuses settings with RuntimeError, ValueError, its own types
        raise ConfigError(f"Lightning refuses {fields} on this machine: {type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. " + ("Set --trainer.precision "
                          "32-true or bf16-mixed." if "precision" in str(exc).lower() else "Fix the field it names.")) from exc
    finally:
        info.removeFilter(hold)
    asked = str(kwargs.get("precision", "32-true"))
    asked = UNIFIED_PRECISION.get(asked, asked)
    runs = getattr(fabric.strategy.precision, "precision", asked)
    if runs != asked:
        device = fabric.device.type
        raise ConfigError(f"trainer.precision={asked!r} is not supported on the {device}: Lightning would run "
                          f"{runs!r} instead. Set --trainer.precision {runs} to run that, or 32-true (full "
                          f"precision){'; 16-mixed needs a CUDA GPU' if asked == '16-mixed' else ''}.")
    for warning in said:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    for message in dict.fromkeys(record.getMessage() for record in held):  # once each, though two Fabrics said it
        info.info(message)
    return fabric


class _Hold(logging.Filter):
    """Keeps the records of a logger back (in ``held``), to be replayed only if the settings are accepted."""

    def __init__(self, held: list[logging.LogRecord]) -> None:
        super().__init__()
        self.held = held

    def filter(self, record: logging.LogRecord) -> bool:
        self.held.append(record)
        return False


@dataclass
class Checked:
    """What the checks found, for the run to use.

    Attributes:
        placement: Ranks per policy.
        checkpoint: The loaded ``--ckpt_path`` (None: a new run).
        plan_text: The resource plan, as printed.
        threads: CPU threads per worker.
    """

    placement: Placement
    checkpoint: dict[str, Any] | None
    plan_text: str
    threads: int


def _raise(title: str, errors: list[str]) -> None:
    if errors:
        raise ConfigError(f"{title}:\n  - " + "\n  - ".join(errors))


def check_before_build(trainer, model, datamodule, ckpt_path: str | None) -> Checked:
    """Every check of the module docstring, in its order.

    Args:
        trainer: The :class:`~mrl_lightning.loop.trainer.MRLTrainer` (its settings and Fabric).
        model: The :class:`~mrl_lightning.loop.system.MutualRL` system (not built).
        datamodule: The prompt data module (parts known; not set up).
        ckpt_path: ``--ckpt_path`` or None.

    Raises:
        ConfigError: a problem of the placement, callbacks, policies, plan or run folder.
        CheckpointError: ``ckpt_path`` is missing, unreadable, newer, or of another config.
    """
    policies = dict(model.policies)
    fabric = trainer.fabric
    placement = build_placement(trainer.placement_mode, trainer.policy_ranks, list(policies), fabric.world_size)
    trainer.ctx.placement = placement
    named = lambda i, field, name: parsed_file_naming("trainer.callbacks", i, field, name)  # noqa: E731
    _raise("Invalid callbacks config", service_errors(trainer.callbacks) + sharing_errors(trainer.callbacks,
                                                                                          list(policies), named))
    _raise("Invalid callbacks config", [e for cb in trainer.callbacks for e in cb.config_errors(trainer.ctx, model)])
    parts = [part.name for part in datamodule.parts] if isinstance(getattr(datamodule, "parts", None), list) else None
    errors = [e for i, p in enumerate(policies.values()) for e in part_errors(p, i, parts)] + [
        e for p in policies.values() if isinstance(p.model_source, ModelRecipe)
        for e in p.model_source.config_errors(p, datamodule)]
    shapes, shape_errors = plan_shapes(policies, datamodule)  # configs only (LoRA on the meta device)
    if trainer.placement_mode != "cost":  # cost checks the placement it chooses (step 5)
        shape_errors += sharding_errors(placement, policies, datamodule.batch_size)
    _raise("Invalid policy config", errors + shape_errors or prompt_errors(policies, datamodule))  # data's prompts
    checkpoint = load_checkpoint(ckpt_path, policies=()) if ckpt_path else None  # the manifest: parts at restore
    if checkpoint is not None:  # (under mrl replay its own checkpoint holds only the policies it trains)
        trained = [n for n in policies if n not in getattr(getattr(trainer, "replay_log", None), "logged", ())]
        names = trained if sorted(checkpoint_policies(checkpoint)) == sorted(trained) else list(policies)
        check_compatible(checkpoint, names, trainer.max_steps, data_parts=[part.name for part in datamodule.parts],
                         models=_expected_models({n: policies[n] for n in names}, shapes, datamodule), path=ckpt_path)
    placement, cost_text = place_by_cost(trainer, placement, policies, shapes, datamodule.batch_size, checkpoint)
    if placement != trainer.ctx.placement:  # chosen by cost: the callbacks' checks again, on the placement run
        trainer.ctx.placement = placement
        _raise("Invalid callbacks config", [e for cb in trainer.callbacks for e in cb.config_errors(trainer.ctx, model)])
    if trainer.placement_mode == "cost":
        _raise("Invalid policy config", sharding_errors(placement, policies, datamodule.batch_size))
    plan_text, threads = plan_resources(placement, shapes, policies, datamodule.batch_size, fabric.device.type,
                                        type(fabric.strategy).__name__, trainer.precision, trainer.devices_per_node,
                                        trainer.num_threads, eval_prompts=eval_prompts(datamodule),
                                        eval_generations=trainer.eval_num_generations,
                                        compress=trainer.compress_checkpoints, sampler_copy=trainer.async_rollouts)
    plan_text += cost_text + source_lines(policies, datamodule)
    if fabric.global_rank == 0:
        check_run_folder(trainer.log_dir, trainer.default_root_dir)
    return Checked(placement, checkpoint, plan_text, threads)


def source_lines(policies: dict, datamodule) -> str:
    """The plan's "Model sources" block: what each recipe-built policy loads (a GGUF file, its quantization
    and sha256, its cache folder: :meth:`ModelRecipe.describe <mrl_lightning.model.source.ModelRecipe.describe>`);
    empty when no recipe has anything to say (the tiny default)."""
    lines = [line for p in policies.values() if isinstance(p.model_source, ModelRecipe)
             and (line := p.model_source.describe(p, datamodule))]
    return "\nModel sources:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def _expected_models(policies: dict, shapes: dict, datamodule) -> dict[str, dict[str, Any]]:
    """What each policy's checkpoint entry must look like (:func:`~mrl_lightning.run.checkpoint.check_compatible`)."""
    out = {}
    for name, policy in policies.items():
        shape = shapes.get(name)
        if shape is None or shape.state_shapes is None:
            continue  # config unreadable (e.g. an offline hub id): checked when the weights load
        source = policy.model_source
        unbuilt = isinstance(source, ModelRecipe) and source.built_folder(policy, datamodule) is None
        out[name] = {"family": shape.family, "adapter": bool(policy.use_peft), "shapes": shape.state_shapes,
                     "lora_alpha": float(policy.lora_alpha) if policy.use_peft else None,
                     "open_size": shape.vocab if unbuilt else None}
    return out
