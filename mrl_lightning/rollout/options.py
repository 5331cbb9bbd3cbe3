"""A policy's rollout-engine settings, checked before anything is built (docs/rollout.md).

Pure: nothing here imports an engine, vLLM or torch, so a policy can check its
``rollout_engine`` / ``vllm_*`` options at construction (the engines stay above the
policy in the import graph). The engine is built later, by
:func:`mrl_lightning.builders.engines.build_vllm_engine`.
"""

from __future__ import annotations

import importlib.util

ROLLOUT_ENGINES = ("hf", "vllm")
VLLM_MODES = ("colocate", "server")
# The versions whose source this module was written against (pyproject's `vllm` extra).
VLLM_VERSIONS = ">=0.32,<0.34"


def missing_packages(mode: str) -> list[str]:
    """Packages a vLLM engine in ``mode`` needs that this environment lacks (``vllm``; ``trl`` for a server)."""
    needed = ["vllm"] + (["trl"] if mode == "server" else [])
    return [name for name in needed if importlib.util.find_spec(name) is None]


def engine_config_errors(where: str, policy) -> list[str]:
    """Problems of a policy's ``rollout_engine`` / ``vllm_*`` settings, without importing vLLM.

    Args:
        where: Prefix naming the policy, e.g. ``"policy 'qwen'"``.
        policy: The :class:`~mrl_lightning.policy.PolicyModule` (its attributes are read).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    from mrl_lightning.rollout.draws import SAMPLING_DRAWS

    errors = []
    if policy.rollout_engine not in ROLLOUT_ENGINES:
        errors.append(f"{where}: rollout_engine={policy.rollout_engine!r}; valid: {list(ROLLOUT_ENGINES)}.")
    if policy.sampling_draw not in SAMPLING_DRAWS:
        errors.append(f"{where}: sampling_draw={policy.sampling_draw!r}; valid: {list(SAMPLING_DRAWS)} (how the hf "
                      "engine draws each token from its prompt's seed; docs/rollout.md).")
    if policy.vllm_mode not in VLLM_MODES:
        errors.append(f"{where}: vllm_mode={policy.vllm_mode!r}; valid: {list(VLLM_MODES)}.")
    share = policy.vllm_gpu_memory_utilization
    if share is not None and not 0 < share < 1:
        errors.append(f"{where}: vllm_gpu_memory_utilization={share} must be in (0, 1) (the fraction of the GPU's "
                      "memory this engine may hold), or null to take the share the MWRA plan leaves.")
    if not 0 < policy.vllm_server_port < 65536 or not 0 < policy.vllm_group_port < 65536:
        errors.append(f"{where}: vllm_server_port={policy.vllm_server_port} and vllm_group_port="
                      f"{policy.vllm_group_port} must be TCP ports in 1-65535.")
    if not policy.vllm_server_timeout > 0:
        errors.append(f"{where}: vllm_server_timeout={policy.vllm_server_timeout} must be > 0 seconds.")
    errors.extend(importance_sampling_errors(where, policy.vllm_importance_sampling_mode,
                                             policy.vllm_importance_sampling_clip_max,
                                             policy.vllm_importance_sampling_clip_min))
    if policy.rollout_engine == "vllm" and policy.vllm_mode in VLLM_MODES:
        missing = missing_packages(policy.vllm_mode)
        if missing:
            errors.append(f"{where}: rollout_engine='vllm' (vllm_mode={policy.vllm_mode!r}) needs {missing}, not "
                          "installed here. On a CUDA machine run pip install -e '.[vllm]' (vllm "
                          f"{VLLM_VERSIONS}), or set rollout_engine: hf.")
    return errors


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_errors(where: str, mode: str, clip_max: float | None, clip_min: float | None) -> list[str]:
    """Problems of an importance-sampling setting (for config checks).

    Args:
        where: Prefix naming the config entry, e.g. ``"policy 'qwen'"``.
        mode: One of :data:`IS_MODES`.
        clip_max: Upper bound C_max (> 0) or None.
        clip_min: Lower bound C_min (>= 0) or None.

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    errors = []
    if mode not in IS_MODES:
        errors.append(f"{where}: vllm_importance_sampling_mode={mode!r}; valid: {list(IS_MODES)}.")
    if clip_max is not None and not clip_max > 0:
        errors.append(f"{where}: vllm_importance_sampling_clip_max={clip_max} must be > 0 (TRL's default 3.0) or null.")
    if clip_min is not None and not clip_min >= 0:
        errors.append(f"{where}: vllm_importance_sampling_clip_min={clip_min} must be >= 0 or null.")
    if clip_max is not None and clip_min is not None and not clip_min < clip_max:
        errors.append(f"{where}: vllm_importance_sampling_clip_min={clip_min} must be below "
                      f"vllm_importance_sampling_clip_max={clip_max}.")
    if mode.endswith("_truncate") and clip_max is None and clip_min is None:
        errors.append(f"{where}: vllm_importance_sampling_mode={mode!r} truncates to [clip_min, clip_max] but both are "
                      "null; set vllm_importance_sampling_clip_max: 3.0 (TRL's default).")
    return errors
