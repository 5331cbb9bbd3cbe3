"""Building a policy's model: its folder (a recipe materializes one), tokenizer, model and reference.

The policy (:mod:`mrl_lightning.policy`) holds the config; this room turns it into
weights: :func:`materialize` gives the folder or hub id to load (a
:class:`~mrl_lightning.model.source.ModelRecipe` builds or finds its cached folder
first), :func:`build_policy` loads the tokenizer everywhere and the model (and, when
``beta > 0``, a frozen reference) where the policy runs, :func:`model_config` reads the
config alone for the MWRA plan. Rollout engines are built where they are used
(:func:`mrl_lightning.builders.engines.build_vllm_engine`, at a policy's first rollout).
"""

from __future__ import annotations

import os

import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.model.hub import hub_load_kwargs, quiet_local_load
from mrl_lightning.model.source import ModelRecipe
from mrl_lightning.mwra.rng import rng_state, set_rng_state
from mrl_lightning.mwra.sharding import shard_model
from mrl_lightning.policy.module import PolicyModule
from mrl_lightning.policy.checks import tokenizer_errors
from mrl_lightning.policy.prompt_fit import data_prompt_errors


def materialize(policy: PolicyModule, datamodule=None, cache_log=print, resuming: bool = False) -> str:
    """The folder (or hub id) to load ``policy`` from; a recipe builds its cached folder first.

    A recipe's build (init and warm-start) runs with the random generators saved and
    restored, so a cache miss leaves them as a cache hit does. A recipe that warm-starts on
    a part sets the policy's ``strong_parts`` to it when the config left them unset.

    Args:
        policy: The policy.
        datamodule: The data module (a recipe's corpus and warm-start prompts).
        cache_log: Where a recipe's progress and cache lines go.
        resuming: The run resumes from a checkpoint, whose weights replace the built ones:
            a cached warm-start that missed its target is not warned about again (unless
            ``beta > 0``: the reference model is still the built one).

    Raises:
        ValueError: the recipe does not fit the data (e.g. its warm-start part is not a data part).
    """
    source = policy.model_source
    if isinstance(source, ModelRecipe):
        saved = rng_state()
        try:
            source = str(source.materialize(policy, datamodule, log=cache_log,
                                            warn_shortfall=not resuming or policy.beta > 0))
        finally:
            set_rng_state(saved)
        if policy.strong_parts is None and source and policy.model_source.strong_parts:
            policy.strong_parts = list(policy.model_source.strong_parts)
    return os.path.expanduser(source)


def model_config(policy: PolicyModule, datamodule=None):
    """The model's ``transformers`` config without loading weights; None when unreadable.

    A recipe gives the config it would build (vocabulary at its upper bound), or, given the
    data module, the exact config of the folder an earlier run built (a cache hit); a folder
    or hub id is read with ``AutoConfig.from_pretrained`` (offline hub ids give None).
    """
    source = policy.model_source
    if isinstance(source, ModelRecipe):
        built = source.built_folder(policy, datamodule) if datamodule is not None else None
        if built is None:
            return source.model_config()
        source = str(built)
    try:
        from transformers import AutoConfig

        source = os.path.expanduser(source)
        return AutoConfig.from_pretrained(source, **hub_load_kwargs(source, "model", policy.policy_name))
    except Exception:  # noqa: BLE001 - the plan then says "?" for this policy
        return None


def build_policy(policy: PolicyModule, datamodule=None, cache_log=print, with_model: bool = True) -> None:
    """Materialize (recipe), then load the tokenizer and, with ``with_model``, the model.

    A worker that does not run this policy still needs its tokenizer (THL maps the
    policy's text and tokens for its peers), so it builds with ``with_model=False``. The
    model is float32 in train mode (``from_pretrained`` returns eval mode), with transformers'
    gradient checkpointing when ``gradient_checkpointing``, wrapped in a LoRA adapter
    (``peft.get_peft_model``, :func:`lora_config`) when ``use_peft``, and with every dropout
    probability 0 (the adapter's too) when ``disable_dropout``; with ``beta > 0`` a second
    copy, frozen and in eval mode, becomes the reference (:meth:`PolicyModule.attach_reference`),
    except for a LoRA policy, whose reference is its own base with the adapter disabled.

    Raises:
        ConfigError: the tokenizer fails its checks (no pad or EOS token, chat template, ...).
    """
    from transformers import AutoModelForCausalLM

    source = materialize(policy, datamodule, cache_log)
    if policy.tokenizer is None:
        errors = tokenizer_errors(policy, os.path.expanduser(policy.tokenizer_source or source))
        if not errors and datamodule is not None and not getattr(policy, "_data_prompts_checked", False):
            errors = data_prompt_errors(policy, datamodule)  # a recipe's tokenizer made just now: the data's prompts
        if errors:
            raise ConfigError("\n".join(errors))
    if not with_model:
        return
    hub = hub_load_kwargs(source, "model", f"policy {policy.policy_name!r}")
    with quiet_local_load(source):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **hub)
    if policy.gradient_checkpointing:  # transformers' own; the non-reentrant kind needs no input grads
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if policy.use_peft:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(policy))
    model.train()
    if policy.disable_dropout:  # after the adapter is in: its dropout too
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
                module.attention_dropout = 0.0
    policy.model = model
    if policy.beta > 0 and not policy.use_peft:  # a LoRA policy's reference is its base, adapter off
        with quiet_local_load(source):
            ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **hub).eval()
        ref.requires_grad_(False)
        policy.attach_reference(ref)


def lora_config(policy: PolicyModule):
    """The ``peft.LoraConfig`` of a ``use_peft`` policy (``lora_*`` options; task ``CAUSAL_LM``)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=policy.lora_r, lora_alpha=policy.lora_alpha,
                      lora_dropout=policy.lora_dropout, target_modules=policy.lora_target_modules,
                      modules_to_save=policy.lora_modules_to_save)


def plan_shapes(policies: dict[str, PolicyModule], datamodule=None) -> tuple[dict, list[str]]:
    """Each policy's :class:`~mrl_lightning.mwra.plan.ModelShape` for the resource plan, from its config alone.

    For a ``use_peft`` policy the adapter is put on the model built on the meta device (no
    memory, no weights), which counts its trainable parameters, gives the shapes of what its
    checkpoint holds (the adapter's) and shows whether the ``lora_target_modules`` exist,
    before any weight is loaded.

    Args:
        policies: Policy name -> policy.
        datamodule: Given, a recipe found in its cache gives its exact config (:func:`model_config`).

    Returns:
        Policy name -> shape (None when the config cannot be read), and the config errors found.
    """
    from mrl_lightning.mwra.plan import model_shape

    shapes, errors = {}, []
    for name, policy in policies.items():
        config = model_config(policy, datamodule)
        shapes[name] = shape = model_shape(config) if config is not None else None
        if shape is None or not policy.use_peft:
            continue
        trainable, error, adapter_shapes = _meta_adapter(policy, config)
        if error:
            errors.append(error)
        else:
            shape.trainable, shape.state_shapes = trainable, adapter_shapes
    return shapes, errors


def _meta_adapter(policy: PolicyModule, config) -> tuple[int, str | None, dict | None]:
    """``(trainable parameters, error, adapter state shapes)`` of the policy's adapter on its model built on
    the meta device."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules()
                         if isinstance(m, (torch.nn.Linear, Conv1D))})
        try:
            model = get_peft_model(base, lora_config(policy))
        except ValueError as exc:
            return 0, (f"policy {policy.policy_name!r}: lora_target_modules={policy.lora_target_modules!r} does not "
                       f"fit the model ({str(exc).splitlines()[0]}); its linear layers are {linear}, e.g. "
                       f"lora_target_modules: {linear[:2]} or all-linear."), None
        adapter = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    return sum(p.numel() for p in model.parameters() if p.requires_grad), None, adapter


def build_on_rank(system, datamodule, workers, fabric, log, resuming: bool = False) -> dict[str, tuple]:
    """Build every policy of the run on this rank: recipes materialized by each policy's group leader,
    tokenizers everywhere, models (weights broadcast from the leader, sharded over the group when
    ``fsdp``, set up by Fabric with their optimizer) where the policy runs.

    Args:
        system: The :class:`~mrl_lightning.loop.system.MutualRL` system.
        datamodule: The data module (set up here for ``"fit"``).
        workers: This rank's :class:`~mrl_lightning.mwra.Workers`.
        fabric: The Fabric instance (``setup``, the device of the reference models).
        log: Prints a recipe's progress and cache lines (on whichever rank materializes).
        resuming: The weights then come from a checkpoint, so a recipe's warm-start shortfall
            (said when the run first built it) is not repeated, except for a policy with
            ``beta > 0``, whose reference model is still the built one.

    Returns:
        Policy name -> ``(Fabric-wrapped model, optimizer)`` for the policies this rank runs.

    Raises:
        ConfigError: a tokenizer fails its checks.
        ValueError: a recipe does not fit the data.
    """
    datamodule.setup("fit")
    for name, policy in system.policies.items():
        if workers.is_leader(name):
            materialize(policy, datamodule, cache_log=log, resuming=resuming)
    workers.barrier("materialize")
    modules = {}
    for name, policy in system.policies.items():
        local = name in workers.local_policies
        # the cache lines were printed by the materializing rank above: not twice
        build_policy(policy, datamodule, cache_log=lambda _msg: None, with_model=local)
        if not local:
            continue
        workers.broadcast_module(name, policy.model)  # the leader's weights on every rank of the group
        if policy.fsdp:  # FSDP2 over the policy's own group (mwra/sharding.py), before its optimizer exists
            policy.model.to(fabric.device)
            shard_model(policy.model, workers.process_group(name), fabric.device.type)
        modules[name] = fabric.setup(policy.model, policy.configure_optimizers())
        if policy.ref_model is not None:
            policy.ref_model.to(fabric.device)
            if policy.fsdp:  # the frozen reference sharded alike: no full copy per rank
                shard_model(policy.ref_model, workers.process_group(name), fabric.device.type, reshard_root=True)
    return modules
