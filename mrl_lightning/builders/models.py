"""Building a policy's model: its folder (a recipe materializes one), tokenizer, model and reference.

The policy (:mod:`mrl_lightning.policy`) holds the config; this room turns it into
weights: :func:`materialize` gives the folder or hub id to load (a
:class:`~mrl_lightning.model_source.ModelRecipe` builds or finds its cached folder
first), :func:`build_policy` loads the tokenizer everywhere and the model (and, when
``beta > 0``, a frozen reference) where the policy runs, :func:`model_config` reads the
config alone for the MWRA plan. Rollout engines are built where they are used
(:func:`mrl_lightning.builders.engines.build_vllm_engine`, at a policy's first rollout).
"""

from __future__ import annotations

import os

import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.hub import hub_load_kwargs, quiet_local_load
from mrl_lightning.model_source import ModelRecipe
from mrl_lightning.mwra.rng import rng_state, set_rng_state
from mrl_lightning.policy import PolicyModule
from mrl_lightning.policy_checks import tokenizer_errors


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


def model_config(policy: PolicyModule):
    """The model's ``transformers`` config without loading weights; None when unreadable.

    A recipe gives the config it would build (vocabulary at its upper bound); a folder
    or hub id is read with ``AutoConfig.from_pretrained`` (offline hub ids give None).
    """
    if isinstance(policy.model_source, ModelRecipe):
        return policy.model_source.model_config()
    try:
        from transformers import AutoConfig

        source = os.path.expanduser(policy.model_source)
        return AutoConfig.from_pretrained(source, **hub_load_kwargs(source, "model", policy.policy_name))
    except Exception:  # noqa: BLE001 - the plan then says "?" for this policy
        return None


def build_policy(policy: PolicyModule, datamodule=None, cache_log=print, with_model: bool = True) -> None:
    """Materialize (recipe), then load the tokenizer and, with ``with_model``, the model.

    A worker that does not run this policy still needs its tokenizer (THL maps the
    policy's text and tokens for its peers), so it builds with ``with_model=False``. The
    model is float32 in train mode (``from_pretrained`` returns eval mode), with every
    dropout probability 0 when ``disable_dropout``; with ``beta > 0`` a second copy, frozen
    and in eval mode, becomes the reference (:meth:`PolicyModule.attach_reference`).

    Raises:
        ConfigError: the tokenizer fails its checks (no pad or EOS token, chat template, ...).
    """
    from transformers import AutoModelForCausalLM

    source = materialize(policy, datamodule, cache_log)
    if policy.tokenizer is None:
        errors = tokenizer_errors(policy, os.path.expanduser(policy.tokenizer_source or source))
        if errors:
            raise ConfigError("\n".join(errors))
    if not with_model:
        return
    hub = hub_load_kwargs(source, "model", f"policy {policy.policy_name!r}")
    with quiet_local_load(source):
        policy.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **hub)
    policy.model.train()
    if policy.disable_dropout:
        for module in policy.model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if hasattr(module, "attention_dropout") and isinstance(module.attention_dropout, float):
                module.attention_dropout = 0.0
    if policy.beta > 0:
        with quiet_local_load(source):
            ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **hub).eval()
        ref.requires_grad_(False)
        policy.attach_reference(ref)


def build_on_rank(system, datamodule, workers, fabric, log, resuming: bool = False) -> dict[str, tuple]:
    """Build every policy of the run on this rank: recipes materialized by each policy's group leader,
    tokenizers everywhere, models (set up by Fabric with their optimizer, weights broadcast from the
    leader) where the policy runs.

    Args:
        system: The :class:`~mrl_lightning.system.MutualRL` system.
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
        modules[name] = fabric.setup(policy.model, policy.configure_optimizers())
        workers.broadcast_module(name, policy.model)
        if policy.ref_model is not None:
            policy.ref_model.to(fabric.device)
    return modules
