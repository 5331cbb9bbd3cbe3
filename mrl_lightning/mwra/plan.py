"""MWRA resource plan: ranks, device, strategy, threads and a memory estimate per worker (docs/mwra.md).

Built from the config and each model's *config* (parameters are counted on the meta
device, nothing is loaded), validated, and printed before any model is built.

Estimated peak memory of a worker (one process), GiB: on the CPU, the process's own
footprint measured when the plan is built (Python, torch, Lightning, the tokenizers loaded
by then: about 0.4-0.7 GB here), plus every policy it runs' resident states, plus the
largest transient of one of its policies (a worker runs one phase of one policy at a time),
plus, on CPU workers, every tokenizer not loaded yet; each term is
:mod:`mrl_lightning.mwra.memory`'s.

Not counted: the SEE exchange buffer (bounded by its own capacity), the probes' own rows,
the CUDA context (~0.3-0.5 GiB per GPU). The loop logs the measured peak
(``mwra/<policy>/peak_memory_gib``) so the two can be compared, and
``benchmarks/memory_peaks.py`` measures every phase's.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra.memory import (  # noqa: F401 - also from here
    ALLOCATOR_SLACK,
    CPU_BF16_KERNEL_CACHE_GIB,
    GIB,
    ModelShape,
    largest_transient,
    model_shape,
    policy_memory_bytes,
    policy_memory_parts,
    policy_memory_terms,
)
from mrl_lightning.mwra.placement import Placement
from mrl_lightning.mwra.process import (  # noqa: F401 - also from here
    available_cores,
    omp_threads,
    peak_memory_gib,
    process_rss_bytes,
)


@dataclass
class PolicyPlacement:
    """One row of the plan.

    Attributes:
        policy: Policy name.
        family: ``config.model_type`` ("?" when the config could not be read).
        params: Parameters (None when unknown).
        vocab: Vocabulary size of the model (None when unknown).
        ranks: Global ranks that run this policy.
        device: Accelerator type ("cpu", "cuda").
        strategy: Fabric strategy in use.
        precision: Fabric precision.
        threads: CPU threads per worker (``torch.set_num_threads``).
        memory_gib: Estimated memory of this policy on each of its workers while its phase
            runs (states + its largest transient: :func:`~mrl_lightning.mwra.memory.policy_memory_parts`),
            GiB (None = unknown).
        states_gib: The resident part of ``memory_gib`` (weights, gradients, optimizer
            moments, reference model), GiB (None = unknown).
        size_is_bound: ``params`` and ``vocab`` are upper bounds: a recipe trains its tokenizer
            when it is built (after the plan), and may stop below the vocabulary asked for
            (shown as ``<=`` in :func:`format_plan`).
        memory: The memory options on for this policy (``LoRA r=16 (0.52M trainable)``,
            ``grad. ckpt``), or ``full`` (every weight trained, activations kept).
        tokenizer_gib: Host memory of its tokenizer when the plan has not loaded it (a
            recipe's), GiB; every worker loads it.
        checkpoint_gib: Its part of a checkpoint (kept weights and AdamW moments), GiB.
        peak: The phase of its largest transient (``update``, ``optimizer step``, ``sampling``,
            ``evaluation``, ``checkpoint``: :func:`~mrl_lightning.mwra.memory.largest_transient`).
        settings: The policy's settings the estimate grows with (``max_completion_length=32,
            num_generations=4, ...``), named when the plan does not fit (:func:`validate_resources`).
    """

    policy: str
    family: str
    params: int | None
    vocab: int | None
    ranks: tuple[int, ...]
    device: str
    strategy: str
    precision: str
    threads: int
    memory_gib: float | None
    states_gib: float | None = None
    size_is_bound: bool = False
    memory: str = "full"
    tokenizer_gib: float = 0.0
    checkpoint_gib: float = 0.0
    peak: str = "?"
    settings: str = ""


def build_plan(
    placement: Placement,
    shapes: dict[str, ModelShape | None],
    policies: dict,
    batch_size: int,
    device: str,
    strategy: str,
    precision: str,
    threads: int,
    *,
    eval_prompts: int = 0,
    eval_generations: int = 0,
    compress: bool = False,
    sampler_copy: bool = False,
) -> list[PolicyPlacement]:
    """One :class:`PolicyPlacement` per policy.

    Args:
        placement: Ranks per policy.
        shapes: Policy name -> :class:`ModelShape` (None when its config is unreadable).
        policies: Policy name -> PolicyModule (generation and batch settings).
        batch_size: B prompts per step (split over a policy's ranks).
        device: Accelerator type.
        strategy: Fabric strategy name.
        precision: Fabric precision.
        threads: CPU threads per worker.
        eval_prompts: Held-out prompts of the data's largest part (split over a policy's ranks;
            0 = evaluation not counted).
        eval_generations: ``trainer.eval_num_generations``.
        compress: ``trainer.compress_checkpoints``.
        sampler_copy: ``trainer.async_rollouts`` (a second copy of the weights; :func:`policy_memory_terms`).
    """
    rows = []
    for name, ranks in placement.groups.items():
        shape = shapes.get(name)
        workload = dict(eval_prompts_per_rank=-(-eval_prompts // len(ranks)), eval_generations=eval_generations,
                        compress=compress, sampler_copy=sampler_copy)
        per_rank = -(-batch_size // len(ranks))
        terms = policy_memory_terms(shape, policies[name], per_rank, len(ranks), **workload) if shape else {}
        phase, peak = largest_transient(terms, host=device == "cpu") if shape else ("?", None)
        states = terms.get("states")
        rows.append(PolicyPlacement(
            policy=name, family=shape.family if shape else "?", params=shape.params if shape else None,
            vocab=shape.vocab if shape else None, ranks=ranks, device=device, strategy=strategy,
            precision=precision, threads=threads, memory_gib=(states + peak) / GIB if shape else None,
            states_gib=states / GIB if shape else None,
            # a recipe's sizes are upper bounds until its tokenizer is trained
            size_is_bound=bool(getattr(policies[name], "builds_from_recipe", False)),
            memory=memory_options(policies[name], shape, len(ranks)),
            tokenizer_gib=terms.get("tokenizer", 0.0) / GIB, checkpoint_gib=terms.get("checkpoint", 0.0) / GIB,
            peak=phase, settings=memory_settings(policies[name], batch_size, len(ranks)),
        ))
    return rows


def memory_settings(policy, batch_size: int, ranks: int) -> str:
    """The settings of ``policy`` its memory estimate grows with, as a config writes them: the completion length
    and prompts' (sampling's KV cache, the update's activations), the group size, the prompts per step (split over
    its ``ranks``) and the update's micro-batch (docs/mwra.md, "The memory model")."""
    get = lambda key: "null" if (v := getattr(policy, key, "?")) is None else v  # noqa: E731 - as YAML writes it
    per_rank = f" ({-(-batch_size // ranks)} per rank)" if ranks > 1 else ""
    return (f"max_completion_length={get('max_completion_length')}, max_prompt_length={get('max_prompt_length')}, "
            f"num_generations={get('num_generations')}, data.batch_size={batch_size}{per_rank}, "
            f"micro_batch_size={get('micro_batch_size')}")


def memory_options(policy, shape: ModelShape | None, shards: int = 1) -> str:
    """The plan's ``memory`` cell: which of LoRA, FSDP and gradient checkpointing are on."""
    parts = [f"FSDP/{shards}"] if getattr(policy, "fsdp", False) else []
    if getattr(policy, "use_peft", False):
        count = f" ({shape.trainable / 1e6:.2f}M trainable)" if shape is not None and shape.trainable else ""
        parts.append(f"LoRA r={policy.lora_r}{count}")
    if getattr(policy, "gradient_checkpointing", False):
        parts.append("grad. ckpt")
    return ", ".join(parts) or "full"


def worker_memory_gib(rows: list[PolicyPlacement], rank: int, framework_gib: float) -> float:
    """Estimated peak memory of worker ``rank``, GiB (docs/mwra.md, "The memory model").

    ``framework_gib`` + (every policy's resident states + the largest transient of one of its
    policies: a worker runs its policies' phases one at a time) x (1 +
    :data:`~mrl_lightning.mwra.memory.ALLOCATOR_SLACK`); CPU workers also hold every policy's
    tokenizer not loaded when the plan was built (:attr:`PolicyPlacement.tokenizer_gib`), host
    memory a GPU worker does not count.
    """
    mine = [r for r in rows if rank in r.ranks and r.memory_gib is not None]
    states = [r.states_gib if r.states_gib is not None else r.memory_gib for r in mine]
    peaks = [r.memory_gib - s for r, s in zip(mine, states)]
    host = bool(mine) and mine[0].device == "cpu"
    tokenizers = sum(r.tokenizer_gib for r in rows) if host else 0.0
    return framework_gib + tokenizers + (sum(states) + max(*peaks, 0.0, 0.0)) * (1 + ALLOCATOR_SLACK)


def validate_resources(
    rows: list[PolicyPlacement],
    placement: Placement,
    *,
    device: str,
    devices_per_node: int,
    available_devices: int | None,
    cores: int,
    threads: int,
    threads_given: bool,
    batch_size: int,
    framework_gib: float,
    device_memory_gib: float | None,
    threads_from: str = "trainer.num_threads",
) -> None:
    """Stop a plan that cannot run, before any model is built.

    Args:
        rows: The plan.
        placement: Ranks per policy.
        device: Accelerator type ("cpu", "cuda", ...).
        devices_per_node: ``trainer.devices`` (processes per node).
        available_devices: Accelerators visible on this node (None = not countable, e.g. CPU).
        cores: CPU cores this process may use.
        threads: CPU threads per worker.
        threads_given: Whether the threads were asked for (``trainer.num_threads``, or
            ``OMP_NUM_THREADS`` for CPU workers; else they were derived from the cores).
        threads_from: What asked for them, named in the error: ``"trainer.num_threads"`` or
            ``"OMP_NUM_THREADS"``.
        batch_size: B prompts per step.
        framework_gib: Measured footprint of one process (CPU), GiB.
        device_memory_gib: Memory of one accelerator (CPU: the node's RAM), GiB; None = unknown.

    Raises:
        ConfigError: more ranks than devices, more CPU workers than cores, CPU threads oversubscribed, a
            policy's group larger than the batch, or estimated memory over a known device size (all at once).
    """
    errors = []
    if device == "cpu" and devices_per_node > cores:
        errors.append(f"trainer.devices={devices_per_node} CPU worker processes per node but {cores} CPU core(s): "
                      f"workers would take turns on the cores and the run would be several times slower than "
                      f"with {cores}. Set --trainer.devices {cores} (or fewer).")
    if available_devices is not None and devices_per_node > available_devices:
        errors.append(f"trainer.devices={devices_per_node} but this node has {available_devices} {device} "
                      f"device(s); lower --trainer.devices to {available_devices} (and trainer.policy_ranks with it).")
    if threads_given and threads * devices_per_node > cores:
        fit = max(1, cores // devices_per_node)
        fix = (f"Set --trainer.num_threads {fit} (or leave it unset to split the cores)."
               if threads_from == "trainer.num_threads" else
               f"Set OMP_NUM_THREADS={fit}, or unset it (the cores are then split), or give --trainer.num_threads {fit}.")
        errors.append(f"{threads_from}={threads} x {devices_per_node} worker(s) per node = "
                      f"{threads * devices_per_node} threads on {cores} CPU core(s): workers would slow each other "
                      f"down many times over. {fix}")
    for r in rows:
        if len(r.ranks) > batch_size:
            errors.append(f"policy {r.policy!r} has {len(r.ranks)} ranks but data.batch_size={batch_size}: each rank "
                          f"needs at least one whole prompt. Raise data.batch_size to >= {len(r.ranks)} or give "
                          "the policy fewer ranks (trainer.policy_ranks).")
    if device_memory_gib is not None:
        if device == "cpu":
            need = sum(worker_memory_gib(rows, rank, framework_gib) for rank in range(min(placement.world_size,
                                                                                          devices_per_node)))
            where = f"this node's {device_memory_gib:.1f} GiB of RAM"
        else:
            need = max(worker_memory_gib(rows, rank, 0.0) for rank in range(placement.world_size))
            where = f"one {device} device's {device_memory_gib:.1f} GiB"
        if need > device_memory_gib:
            big = max((r for r in rows if r.memory_gib is not None), key=lambda r: r.memory_gib, default=None)
            if big is not None and big.peak == "evaluation":  # one part's held-out prompts x samples at once
                who = (f"; policy {big.policy!r} takes {big.memory_gib:.1f} GiB of it at its peak (evaluation: one "
                       f"part's held-out prompts, data.eval_size, times trainer.eval_num_generations, sampled at "
                       f"once, with max_completion_length): lower data.eval_size or trainer.eval_num_generations "
                       f"(0 = greedy only),")
            else:
                who = (f"; policy {big.policy!r} takes {big.memory_gib:.1f} GiB of it at its peak ({big.peak}), driven "
                       f"by {big.settings}: lower max_completion_length, num_generations or data.batch_size, or set "
                       f"micro_batch_size, for model.policies '{big.policy}'," if big is not None and big.settings
                       else "; lower max_completion_length, num_generations or data.batch_size, set micro_batch_size,")
            errors.append(f"the plan needs an estimated {need:.1f} GiB but {where}{who} or use more devices "
                          "(--trainer.devices, trainer.policy_ranks), lower precision, or smaller models.")
    if errors:
        raise ConfigError("Invalid resource plan (MWRA):\n  - " + "\n  - ".join(errors))


def format_plan(rows: list[PolicyPlacement], placement: Placement, framework_gib: float,
                kernel_cache_gib: float = 0.0) -> str:
    """The plan as a plain-text table plus one line per worker total (``kernel_cache_gib``: a CPU worker's
    bf16 kernel cache, :data:`~mrl_lightning.mwra.memory.CPU_BF16_KERNEL_CACHE_GIB`, added to each)."""
    def ranks_text(ranks: tuple[int, ...]) -> str:
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"

    header = ("policy", "family", "params", "vocab", "ranks", "device", "strategy", "precision", "threads",
              "memory", "peak", "est. GiB/worker")
    bound = lambda r: "<=" if r.size_is_bound else ""  # noqa: E731
    body = [(r.policy, r.family, "?" if r.params is None else f"{bound(r)}{r.params / 1e6:.2f}M",
             "?" if r.vocab is None else f"{bound(r)}{r.vocab}", ranks_text(r.ranks), r.device, r.strategy, r.precision,
             str(r.threads), r.memory, r.peak, "?" if r.memory_gib is None else f"{r.memory_gib:.3f}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"placement: {placement.mode}, {placement.world_size} worker(s)", line(header),
           line(["-" * w for w in widths])] + [line(b) for b in body]
    totals = ", ".join(f"rank {k}: {worker_memory_gib(rows, k, framework_gib + kernel_cache_gib):.2f}"
                       for k in range(min(placement.world_size, 8)))
    kernels = f", {kernel_cache_gib:.2f} GiB of bf16 kernel cache" if kernel_cache_gib else ""
    out.append(f"estimated GiB per worker incl. {framework_gib:.2f} GiB measured process footprint{kernels} and "
               f"{ALLOCATOR_SLACK:.0%} allocator slack (not counted: exchange buffer, CUDA context): {totals}"
               + (" ..." if placement.world_size > 8 else ""))
    if any(r.size_is_bound for r in rows):
        out.append("<=: upper bound; a recipe's tokenizer is trained when the model is built and may stop below "
                   "the vocabulary asked for")
    return "\n".join(out)


def plan_resources(placement: Placement, shapes: dict[str, ModelShape | None], policies: dict, batch_size: int,
                   device: str, strategy: str, precision: str, devices_per_node: int,
                   num_threads: int | None, **workload) -> tuple[str, int]:
    """Build, validate and format the run's resource plan, before any model is built.

    Threads per worker: ``num_threads``, else ``OMP_NUM_THREADS`` (a positive integer), else
    the node's cores split evenly over its workers. The device's memory is read from CUDA or,
    on a CPU, the machine's physical memory.

    Args:
        placement: Ranks per policy.
        shapes: Policy name -> its model's shape (:func:`model_shape`), None when unreadable.
        policies: Policy name -> policy (its config is read).
        batch_size: B prompts per step.
        device: ``"cpu"``, ``"cuda"``, ...
        strategy: The Fabric strategy's class name (shown in the plan).
        precision: The Fabric precision (shown; not a term: the estimate counts activations in float32, and
            ``bf16-mixed``'s cast copies of the weights, 2 bytes a parameter, fall inside that, docs/mwra.md).
        devices_per_node: Worker processes per node.
        num_threads: ``trainer.num_threads`` (None = derived as above).
        **workload: ``eval_prompts``, ``eval_generations``, ``compress``, ``sampler_copy`` (:func:`build_plan`).

    Returns:
        The plan as text, and the threads per worker.

    Raises:
        ConfigError: oversubscribed devices, cores or threads, or a memory estimate above the device's (all at once).
    """
    import torch

    cores = available_cores()
    threads = num_threads or omp_threads() or max(1, cores // devices_per_node)
    rows = build_plan(placement, shapes, policies, batch_size, device, strategy, precision, threads, **workload)
    framework = process_rss_bytes() / GIB if device == "cpu" else 0.0
    kernels = CPU_BF16_KERNEL_CACHE_GIB if device == "cpu" and str(precision).startswith("bf16") else 0.0
    if device == "cuda" and torch.cuda.is_available():
        available, memory = torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GIB
    else:
        available = None
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB if device == "cpu" else None
    validate_resources(rows, placement, device=device, devices_per_node=devices_per_node,
                       available_devices=available, cores=cores, threads=threads,
                       threads_given=num_threads is not None or (device == "cpu" and omp_threads() is not None),
                       threads_from="trainer.num_threads" if num_threads is not None else "OMP_NUM_THREADS",
                       batch_size=batch_size,
                       framework_gib=framework + kernels, device_memory_gib=memory)
    return format_plan(rows, placement, framework, kernels), threads


def eval_prompts(datamodule) -> int:
    """Held-out prompts of the data's largest part, as the config gives them before the data loads: the
    module's ``eval_size``, else its parts' largest ``eval_size``; 0 when unknown (a part evaluating on every
    row of its ``eval_source``), so the plan does not count evaluation (docs/mwra.md, "The memory model")."""
    size = getattr(datamodule, "eval_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return max([s for part in getattr(datamodule, "parts", []) if isinstance(s := getattr(part, "eval_size", 0), int)],
               default=0)


def slow_cpu_bf16_line(device_type: str, precision: str) -> str | None:
    """A warning for bf16 on an x86 CPU without bf16 matrix instructions (AVX512-BF16 or AMX); None otherwise.

    There oneDNN's bf16 matmul has no fast kernel: on a 2-core AMD EPYC with AVX2 only, a
    ``[256, 640] x [640, 2048]`` product ran at 0.5 GFLOP/s in bf16 against 52 in float32 (docs/speed.md,
    "The kernel paths of this CPU"), so a ``bf16-mixed`` run is many times slower than ``32-true``. The
    checks know x86 only: another architecture (ARM has its own bf16 instructions) gets None.
    """
    import torch

    if device_type != "cpu" or not str(precision).startswith("bf16"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not all(callable(check) for check in checks) or any(check() for check in checks):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"trainer.precision={precision!r} on a CPU without bf16 matrix instructions (no AVX512-BF16 or AMX; "
            f"torch's kernels: {capability}): bf16 matmuls run here up to 100x slower than float32 (docs/speed.md). "
            "Use --trainer.precision 32-true on this machine.")
