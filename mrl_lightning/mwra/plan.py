"""MWRA resource plan: ranks, device, strategy, threads and a memory estimate per policy.

Built from the config and each model's *config* (parameters are counted on the meta
device, nothing is loaded), validated, and printed before any model is built (docs/mwra.md).

Memory estimate per worker (one process), in GiB, documented for what it is:

- each policy it runs: 4 bytes per parameter (fp32 weights) and 12 more per *trainable*
  parameter (gradients and AdamW's two moments: all of them, or a LoRA adapter's), 4 more
  per parameter for a frozen reference model when ``beta > 0`` (none for LoRA, whose
  reference is the base with the adapter off), all resident;
- on CPU workers, 3.5 KiB per vocabulary entry for every policy's tokenizer not loaded when
  the plan is built (a recipe's): every worker loads every tokenizer (THL reads them);
- for the one policy whose phase runs, the larger of the update's activations of one
  micro-batch (per layer ``34·s·h + 5·a·s²`` bytes per sequence at 16 bits, Korthikanti et
  al. 2022, doubled for fp32, with s = max_prompt_length + max_completion_length, an upper
  bound; with ``gradient_checkpointing`` each layer keeps only its fp32 input, ``4·s·h``,
  plus one layer's activations; plus five float32 copies of the completion logits
  ``[micro, L + 1, V]``) and sampling (the KV cache, plus, with the Hugging Face engine,
  two float32 copies of the ``[N, L, V]`` logits that ``generate`` keeps); on CPU workers
  the checkpoint's gather over processes may be larger still (:func:`checkpoint_gather_gib`);
- on the CPU, the process's own footprint measured when the plan is built (Python, torch,
  Lightning, tokenizers: about 0.5-0.7 GB here), which dominates for tiny models.

Not counted: the SEE exchange buffer (bounded by its own capacity), allocator slack and
fragmentation, the CUDA context (~0.3-0.5 GiB per GPU). The loop logs the measured peak
(``mwra/<policy>/peak_memory_gib``) so the two can be compared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra.placement import Placement
from mrl_lightning.mwra.process import omp_threads, peak_memory_gib, process_rss_bytes  # noqa: F401 - also from here

GIB = 2**30


@dataclass
class ModelShape:
    """What the estimate needs from a model config.

    Attributes:
        family: ``config.model_type``.
        params: Parameters (tied weights counted once).
        vocab: Vocabulary size V.
        hidden: Width h.
        layers: Transformer layers.
        heads: Attention heads a.
        trainable: Parameters the optimizer steps (a LoRA adapter's); None = all of them.
        state_shapes: Name -> shape of every entry of the model's ``state_dict`` (a LoRA
            policy's: its adapter's), what a checkpoint of it holds; None = not counted.
    """

    family: str
    params: int
    vocab: int
    hidden: int
    layers: int
    heads: int
    trainable: int | None = None
    state_shapes: dict[str, tuple[int, ...]] | None = None


def model_shape(config) -> ModelShape:
    """Count a Hugging Face causal LM's parameters on the meta device (no memory, no weights).

    Args:
        config: A ``transformers.PretrainedConfig``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    get = lambda *names: next((getattr(config, n) for n in names if getattr(config, n, None)), 0)  # noqa: E731
    return ModelShape(family=getattr(config, "model_type", "?"), params=params, vocab=get("vocab_size"),
                      hidden=get("hidden_size", "n_embd"), layers=get("num_hidden_layers", "n_layer"),
                      heads=get("num_attention_heads", "n_head"),
                      state_shapes={k: tuple(v.shape) for k, v in model.state_dict().items()})


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
            runs (states + peak activations), GiB (None = unknown).
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


def policy_memory_terms(shape: ModelShape, policy, prompts_per_rank: int, shards: int = 1) -> dict[str, float]:
    """One policy's memory terms, bytes (module docstring; docs/mwra.md, "The resource plan").

    - ``states``: weights, gradients, optimizer moments and reference model, resident on each
      worker that runs the policy (1/``shards`` of them for an ``fsdp`` policy);
    - ``activations``: one micro-batch of the update: every layer's activations (Korthikanti
      et al. 2022, an upper bound) plus 5 float32 copies of its completion logits
      ``[micro, L + 1, V]`` (the forward's logits, their tempered copy, logsumexp's
      exponentials, and in the backward the logits' gradient; the first iteration's entropy
      takes a softmax and a product of the same size);
    - ``kv_cache``: sampling with the Hugging Face engine: the KV cache, plus 2 float32
      copies of ``[N, L, V]`` logits: ``generate`` keeps every step's logits, and the engine
      reads the sampled tokens' log-probs from them one step at a time (at V = 131,072 this is
      most of a sampling worker's peak). A vLLM policy samples in its engine's own memory:
      only the KV cache term is left;
    - ``tokenizer``: host memory of the tokenizer when it is not loaded when the plan is built
      (a recipe's, made after the plan; a hub or folder tokenizer is loaded by the config
      checks and is in the measured footprint): 3.5 KiB per vocabulary entry. Every worker
      loads every policy's tokenizer (THL reads them);
    - ``checkpoint``: this policy's part of a checkpoint, as its group leader sends it: the
      weights it keeps (every weight, or a LoRA adapter's) and AdamW's two moments.

    ``activations`` and ``kv_cache`` exist only while the policy's phase runs, one at a time.
    The constants were measured on a CPU in float32 at V = 32,000 and 131,072
    (``benchmarks/real_path.py``).

    Args:
        shape: The model's shape (:func:`model_shape`).
        policy: The policy (its generation, batch and memory options are read).
        prompts_per_rank: Prompts per step on one of its workers.
        shards: The ranks an ``fsdp`` policy is sharded over (its checkpoint part is whole:
            checkpoints hold full tensors).

    Returns:
        ``states``, ``activations``, ``kv_cache``, ``tokenizer`` and ``checkpoint``, in bytes.
    """
    update_logit_copies = 5    # [micro, L + 1, V] float32 one micro-batch holds at its peak: 4.6-5.1 measured
    sampling_logit_copies = 2  # [N, L, V] float32 Hugging Face sampling holds at its end: 1.0-1.6 measured
    tokenizer_bytes_per_token = 3584  # a fast tokenizer + THL's byte table: 1.7 KiB (Tekken) - 3.3 KiB (Mistral v1)
    n = policy.num_generations * prompts_per_rank
    micro = min(policy.micro_batch_size or n, n)
    length = policy.max_completion_length
    s = policy.max_prompt_length + length
    trainable = shape.params if shape.trainable is None else shape.trainable
    adapter = shape.trainable is not None  # a LoRA policy: the reference is the base, no second copy
    states = 4 * shape.params + 12 * trainable + (4 * shape.params if policy.beta > 0 and not adapter else 0)
    if getattr(policy, "fsdp", False) and shards > 1:  # 1/k of weights, gradients, moments and the reference
        states /= shards
    # built after the plan (a recipe): not in the footprint measured when the plan is built
    tokenizer = tokenizer_bytes_per_token * shape.vocab if getattr(policy, "tokenizer", None) is None else 0
    per_layer = 2 * (34 * s * shape.hidden + 5 * shape.heads * s * s)
    if getattr(policy, "gradient_checkpointing", False):  # each layer's input kept, one layer's activations
        layers = shape.layers * 4 * s * shape.hidden + per_layer
    else:
        layers = shape.layers * per_layer
    activations = micro * (layers + update_logit_copies * 4 * (length + 1) * shape.vocab)
    kv_cache = n * s * shape.layers * 2 * shape.hidden * 4
    if getattr(policy, "rollout_engine", "hf") == "hf":
        kv_cache += sampling_logit_copies * 4 * n * length * shape.vocab
    checkpoint = 4 * (trainable if adapter else shape.params) + 8 * trainable
    return {"states": float(states), "activations": float(activations), "kv_cache": float(kv_cache),
            "tokenizer": float(tokenizer), "checkpoint": float(checkpoint)}


def checkpoint_gather_gib(rows: list[PolicyPlacement], rank: int) -> float:
    """Memory a distributed checkpoint takes for a moment on worker ``rank`` of CPU workers, GiB.

    Each group leader serializes its policies' parts (``torch.save`` bytes, their pickle for
    ``torch.distributed.gather_object``, its tensor: 3 copies of its own part); rank 0 also
    receives them (a buffer of world size + 1 times the largest rank's part, and every other
    rank's part once more). Measured over gloo with 2 and 3 processes: 3.00x on the senders,
    within 1% of this on rank 0 (docs/mwra.md, "The resource plan"). A single process writes
    its state to the file as it pickles it: 0.

    Args:
        rows: The plan (:attr:`PolicyPlacement.checkpoint_gib` per policy; its first rank leads).
        rank: The worker.

    Returns:
        The transient GiB on that worker (0 for one worker).
    """
    world = max((max(r.ranks) for r in rows), default=0) + 1
    if world == 1:
        return 0.0
    parts = [0.0] * world
    for r in rows:
        parts[r.ranks[0]] += r.checkpoint_gib
    if rank != 0:
        return 3 * parts[rank]
    return 3 * parts[0] + sum(parts[1:]) + (world + 1) * max(parts)


def policy_memory_parts(shape: ModelShape, policy, prompts_per_rank: int, shards: int = 1) -> tuple[float, float]:
    """``(states, peak activations)`` of one policy on one worker, bytes: the update's activations
    or the sampling KV cache, whichever is larger (they do not coexist). An ``fsdp`` policy's full
    weights are gathered for its rollouts: counted with the peak."""
    terms = policy_memory_terms(shape, policy, prompts_per_rank, shards)
    if getattr(policy, "fsdp", False) and shards > 1:
        return terms["states"], max(terms["activations"], terms["kv_cache"]) + 4 * shape.params
    return terms["states"], max(terms["activations"], terms["kv_cache"])


def policy_memory_bytes(shape: ModelShape, policy, prompts_per_rank: int) -> float:
    """Memory of one policy on one worker while its phase runs, bytes (states + peak activations)."""
    return sum(policy_memory_parts(shape, policy, prompts_per_rank))


def build_plan(
    placement: Placement,
    shapes: dict[str, ModelShape | None],
    policies: dict,
    batch_size: int,
    device: str,
    strategy: str,
    precision: str,
    threads: int,
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
    """
    rows = []
    for name, ranks in placement.groups.items():
        shape = shapes.get(name)
        per_rank = -(-batch_size // len(ranks))
        states, peak = policy_memory_parts(shape, policies[name], per_rank, len(ranks)) if shape else (None, None)
        terms = policy_memory_terms(shape, policies[name], per_rank, len(ranks)) if shape else {}
        rows.append(PolicyPlacement(
            policy=name, family=shape.family if shape else "?", params=shape.params if shape else None,
            vocab=shape.vocab if shape else None, ranks=ranks, device=device, strategy=strategy,
            precision=precision, threads=threads, memory_gib=(states + peak) / GIB if shape else None,
            states_gib=states / GIB if shape else None,
            # a recipe's sizes are upper bounds until its tokenizer is trained
            size_is_bound=bool(getattr(policies[name], "builds_from_recipe", False)),
            memory=memory_options(policies[name], shape, len(ranks)),
            tokenizer_gib=terms.get("tokenizer", 0.0) / GIB, checkpoint_gib=terms.get("checkpoint", 0.0) / GIB,
        ))
    return rows


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
    """Estimated peak memory of worker ``rank``, GiB.

    ``framework_gib`` + every policy's resident states + the largest of the activations of
    one of its policies (a worker runs its policies' phases one at a time) and, on CPU
    workers, of a distributed checkpoint's gather (:func:`checkpoint_gather_gib`); CPU workers
    also hold every policy's tokenizer not loaded when the plan was built
    (:attr:`PolicyPlacement.tokenizer_gib`). On a GPU those two are host memory: not counted.
    """
    mine = [r for r in rows if rank in r.ranks and r.memory_gib is not None]
    states = [r.states_gib if r.states_gib is not None else r.memory_gib for r in mine]
    peaks = [r.memory_gib - s for r, s in zip(mine, states)]
    host = bool(mine) and mine[0].device == "cpu"
    tokenizers = sum(r.tokenizer_gib for r in rows) if host else 0.0
    checkpoint = checkpoint_gather_gib(rows, rank) if host else 0.0
    return framework_gib + sum(states) + tokenizers + max(*peaks, checkpoint, 0.0)


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
        threads_given: Whether ``trainer.num_threads`` was set (else it was derived).
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
        errors.append(f"trainer.num_threads={threads} x {devices_per_node} worker(s) per node = "
                      f"{threads * devices_per_node} threads on {cores} CPU core(s): workers would slow each other "
                      f"down many times over. Set --trainer.num_threads {max(1, cores // devices_per_node)} "
                      "(or leave it unset to split the cores).")
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
            errors.append(f"the plan needs an estimated {need:.1f} GiB but {where}; use more devices "
                          "(--trainer.devices, trainer.policy_ranks), a smaller micro_batch_size, lower "
                          "precision, or smaller models.")
    if errors:
        raise ConfigError("Invalid resource plan (MWRA):\n  - " + "\n  - ".join(errors))


def format_plan(rows: list[PolicyPlacement], placement: Placement, framework_gib: float) -> str:
    """The plan as a plain-text table plus one line per worker total."""
    def ranks_text(ranks: tuple[int, ...]) -> str:
        return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"

    header = ("policy", "family", "params", "vocab", "ranks", "device", "strategy", "precision", "threads",
              "memory", "est. GiB/worker")
    bound = lambda r: "<=" if r.size_is_bound else ""  # noqa: E731
    body = [(r.policy, r.family, "?" if r.params is None else f"{bound(r)}{r.params / 1e6:.2f}M",
             "?" if r.vocab is None else f"{bound(r)}{r.vocab}", ranks_text(r.ranks), r.device, r.strategy, r.precision,
             str(r.threads), r.memory, "?" if r.memory_gib is None else f"{r.memory_gib:.3f}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"placement: {placement.mode}, {placement.world_size} worker(s)", line(header),
           line(["-" * w for w in widths])] + [line(b) for b in body]
    totals = ", ".join(f"rank {k}: {worker_memory_gib(rows, k, framework_gib):.2f}"
                       for k in range(min(placement.world_size, 8)))
    out.append(f"estimated GiB per worker incl. {framework_gib:.2f} GiB measured process footprint "
               f"(not counted: exchange buffer, allocator slack, CUDA context): {totals}"
               + (" ..." if placement.world_size > 8 else ""))
    if any(r.size_is_bound for r in rows):
        out.append("<=: upper bound; a recipe's tokenizer is trained when the model is built and may stop below "
                   "the vocabulary asked for")
    return "\n".join(out)


def plan_resources(placement: Placement, shapes: dict[str, ModelShape | None], policies: dict, batch_size: int,
                   device: str, strategy: str, precision: str, devices_per_node: int,
                   num_threads: int | None) -> tuple[str, int]:
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
        precision: The Fabric precision (shown; counted in the estimate).
        devices_per_node: Worker processes per node.
        num_threads: ``trainer.num_threads`` (None = derived as above).

    Returns:
        The plan as text, and the threads per worker.

    Raises:
        ConfigError: oversubscribed devices, cores or threads, or a memory estimate above the device's (all at once).
    """
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = num_threads or omp_threads() or max(1, cores // devices_per_node)
    rows = build_plan(placement, shapes, policies, batch_size, device, strategy, precision, threads)
    framework = process_rss_bytes() / GIB if device == "cpu" else 0.0
    if device == "cuda" and torch.cuda.is_available():
        available, memory = torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GIB
    else:
        available = None
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB if device == "cpu" else None
    validate_resources(rows, placement, device=device, devices_per_node=devices_per_node,
                       available_devices=available, cores=cores, threads=threads,
                       threads_given=num_threads is not None, batch_size=batch_size,
                       framework_gib=framework, device_memory_gib=memory)
    return format_plan(rows, placement, framework), threads
