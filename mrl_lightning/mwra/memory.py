"""The resource plan's memory model: one policy's terms on one worker, in bytes (docs/mwra.md, "The memory model").

Built from the model's *config* (parameters counted on the meta device, nothing loaded) and
the policy's options. The terms, for P parameters of which T are trained (all, or a LoRA
adapter's), float32 (``32-true``, or the master weights of ``bf16-mixed``):

- resident on every worker that runs the policy (``states``; 1/k of it for an ``fsdp``
  policy on k ranks): ``weights`` 4·P; ``gradients`` 4·T (kept from one update's backward
  to the next one's ``zero_grad``); ``moments`` 8·T (AdamW's two, from the first step on);
  ``reference`` 4·P when ``beta > 0`` (none for LoRA, whose reference is the base with the
  adapter off);
- transient, one at a time (a worker runs one phase of one policy at a time):
  - ``activations``: one micro-batch of the update: every layer's saved activations,
    ``4·(9h + 5q + 4kv + 4i)`` bytes per token and layer (:data:`ACTIVATION_WIDTHS`; h the
    width, q and kv the query and key/value widths, i the MLP's), over the tokens the forward
    runs (each distinct prompt once and every row's completion with ``share_prompt_forward``,
    plus the prompt's keys and values gathered to every row; else every row over prompt +
    completion), at the longest prompt and completion; the attention scores too when the
    model runs eager attention (sdpa's CPU and flash kernels keep none); with
    ``gradient_checkpointing`` each layer's input ``4h`` per token plus one layer's; plus the
    log-probs' float32 logits: :data:`UPDATE_LOGIT_COPIES` copies of ``[micro, L + 1, V]``
    when taken whole, or :data:`CHUNK_LOGIT_COPIES` copies of one chunk when the policy takes
    them in chunks (:func:`logit_elements`); plus one ``[V, h]`` gradient of the output head
    (tied to the embedding, or accumulated chunk by chunk, it arrives twice);
  - ``optimizer_step``: 4·T, the one temporary of foreach AdamW (``sqrt`` of the second
    moments) beside every resident state (none with ``fused_optimizer``: the fused kernel
    steps each tensor in place);
  - ``kv_cache``: sampling a step's rollouts with the Hugging Face engine: the KV cache
    ``N·s·layers·2·kv·4`` twice (it grows by concatenation), :data:`SAMPLING_STEP_COPIES`
    float32 ``[N, V]`` scores of one decoding step, and :data:`SAMPLING_LOGIT_COPIES` copies
    of the ``[N, L, V]`` logits ``generate`` keeps (a vLLM policy samples in its engine's
    memory: the KV cache term only); an ``fsdp`` policy samples on its full weights, 4·P more;
  - ``eval_sampling``: the same for an evaluation call, which generates one part's held-out
    prompts (this rank's share) times ``eval_num_generations`` (or once, greedy) together;
  - ``checkpoint_write``: writing the policy's part: nothing when plain (``torch.save``
    streams the tensors to the file), two copies of its largest tensor when gzipped (torch
    hands the stream each tensor as one bytes object, and zlib returns its compressed bytes
    whole), the whole part for an ``fsdp`` policy (its full tensors are gathered on every
    rank of its group);
- ``tokenizer``: on CPU workers, 3.5 KiB per vocabulary entry of a tokenizer the plan has
  not loaded yet (a recipe's); every worker loads every policy's tokenizer (THL reads them);
- ``checkpoint``: the policy's part of a checkpoint (its weights or adapter and AdamW's two
  moments), for the record.

The constants were measured on a CPU in float32: what autograd saves, with
``torch.autograd.graph.saved_tensors_hooks``, and every phase's peak RSS, with
``benchmarks/memory_peaks.py`` (docs/mwra.md, "The memory model").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30

UPDATE_LOGIT_COPIES = 5
"""Float32 copies of ``[micro, L + 1, V]`` one micro-batch holds at its peak when its logits are
taken whole: the forward's logits, their tempered copy, logsumexp's exponentials, the backward's
gradient and the entropy's softmax (4.6-5.1 measured)."""

CHUNK_LOGIT_COPIES = 4
"""Float32 copies of one chunk's ``[positions, V]`` logits the chunked log-probs hold at their
peak (the backward of one chunk: recomputed logits, their tempered copy, exponentials, gradient)."""

SAMPLING_LOGIT_COPIES = 0
"""Float32 copies of ``[N, L, V]`` Hugging Face sampling holds at its end: none, since the engine
reads each step's sampled log-probs while ``generate`` runs and keeps no logits
(:mod:`mrl_lightning.rollout.draws`; when ``generate`` kept them, 1.0-1.7 copies were measured)."""

SAMPLING_STEP_COPIES = 6
"""Float32 ``[N, V]`` scores one decoding step holds: the logits, their tempered, filtered and
perturbed copies, the race's noise and its log."""

ACTIVATION_WIDTHS = (9, 5, 4, 4)
"""Float32 values one decoder layer saves for the backward per token, as multiples of
``(h, q, kv, i)``: counted with ``saved_tensors_hooks`` on Gemma 3 (8.8h + 5q + 4kv + 4i: four
norms, query/key norms, rotary inputs, sdpa's inputs and output, a gated MLP's four), Llama
(SmolLM2: 0.74x of this bound, the default's: 0.69x) and GPT-2 (0.88x)."""

ALLOCATOR_SLACK = 0.10
"""The share of a worker's states and largest transient added for what the allocator holds
beyond them (freed blocks not yet returned within a phase, a backward's own temporaries):
the real pair's peaks ran up to 4% above the sum of the terms before the loop trimmed the
freed gradients' heap (docs/mwra.md, "The memory model")."""

TOKENIZER_BYTES_PER_TOKEN = 3584
"""A fast tokenizer and THL's byte table: 1.7 KiB (Tekken) - 3.3 KiB (Mistral v1) per token measured."""

CPU_BF16_KERNEL_CACHE_GIB = 1.0
"""A CPU worker under bf16 autocast: oneDNN keeps a compiled kernel for every matmul shape it has run
(its primitive cache, 1,024 entries by default, about 0.55 MB each here, plus code outside it), and a
run's shapes change with every prompt and completion length. Measured on the real pair: each
worker's peak grew by 1.0-1.2 GiB from step 2 to step 60 under bf16-mixed (docs/mwra.md, "The
memory model"); none in float32. ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` lowers it."""


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
        kv_width: Width of one token's keys (or values) in one layer: key/value heads x head
            size (grouped-query attention keeps fewer than ``hidden``); None = ``hidden``.
        q_width: Width of one token's queries: heads x head size; None = ``hidden``.
        intermediate: The MLP's inner width; None = ``4 * hidden``.
        eager_attention: The model runs eager attention (its scores are saved for the backward).
        config: The ``transformers.PretrainedConfig`` it was read from (the cost calibration builds one layer of it).
    """

    family: str
    params: int
    vocab: int
    hidden: int
    layers: int
    heads: int
    trainable: int | None = None
    state_shapes: dict[str, tuple[int, ...]] | None = None
    kv_width: int | None = None
    q_width: int | None = None
    intermediate: int | None = None
    eager_attention: bool = False
    config: object = field(default=None, repr=False, compare=False)


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
    hidden, heads = get("hidden_size", "n_embd"), get("num_attention_heads", "n_head")
    kv_heads = get("num_key_value_heads") or heads
    head_size = get("head_dim") or (hidden // heads if heads else 0)
    return ModelShape(family=getattr(config, "model_type", "?"), params=params, vocab=get("vocab_size"),
                      hidden=hidden, layers=get("num_hidden_layers", "n_layer"), heads=heads,
                      state_shapes={k: tuple(v.shape) for k, v in model.state_dict().items()},
                      kv_width=kv_heads * head_size or None, q_width=heads * head_size or None,
                      intermediate=get("intermediate_size", "n_inner") or None,
                      eager_attention=getattr(model.config, "_attn_implementation", None) == "eager", config=config)


def logit_elements(policy, rows: int, length: int, vocab: int) -> int:
    """Float32 logits one log-prob call of ``rows`` completions of ``length`` tokens holds at its peak, per copy.

    Whole ``rows * (length + 1) * vocab`` (the model's logits include the position before the first
    completion token) unless the policy takes them in chunks (``policy.logprob_chunk_elements``: logits
    per chunk; the call is chunked when ``rows * length * vocab`` is above it, as the log-prob call
    decides; None, absent or an ``fsdp`` policy = whole); then one chunk's ``(chunk_elements // V) * V``.
    """
    whole = rows * (length + 1) * vocab
    # an fsdp policy takes its logits whole (every rank must run the same head calls)
    chunk = None if getattr(policy, "fsdp", False) else getattr(policy, "logprob_chunk_elements", None)
    if not chunk or rows * length * vocab <= chunk:
        return whole
    return max(1, chunk // vocab) * vocab


def _one_row_logits(policy, length: int, vocab: int) -> float:
    """Bytes of the logits one row's log-prob call holds at its peak (whole or in chunks, as :func:`logit_elements`)."""
    one = logit_elements(policy, 1, length, vocab)
    return float((UPDATE_LOGIT_COPIES if one == (length + 1) * vocab else CHUNK_LOGIT_COPIES) * 4 * one)


def _sampling_bytes(shape: ModelShape, policy, rows: int, kv_only: bool) -> float:
    """The KV cache of ``rows`` sequences of s tokens (twice: it grows by concatenation), one step's
    scores and the logits ``generate`` keeps (module docstring)."""
    s = policy.max_prompt_length + policy.max_completion_length
    kv = 2 * rows * s * shape.layers * 2 * (shape.kv_width or shape.hidden) * 4
    if kv_only:
        return float(kv)
    return float(kv + 4 * rows * shape.vocab * (SAMPLING_STEP_COPIES + SAMPLING_LOGIT_COPIES
                                                * policy.max_completion_length))


def _layer_bytes(shape: ModelShape, policy, micro: int) -> float:
    """What one micro-batch's forward keeps for the backward in its layers, bytes (module docstring)."""
    p, length, g = policy.max_prompt_length, policy.max_completion_length, max(policy.num_generations, 1)
    h, q, kv = shape.hidden, shape.q_width or shape.hidden, shape.kv_width or shape.hidden
    per_token = 4 * sum(c * w for c, w in zip(ACTIVATION_WIDTHS, (h, q, kv, shape.intermediate or 4 * h)))
    shared = getattr(policy, "share_prompt_forward", True) and not (
        getattr(policy, "gradient_checkpointing", False) or getattr(policy, "fsdp", False)) and micro > 1
    if shared:  # each distinct prompt once (a micro-batch not a multiple of G may cut one), then every completion
        distinct = min(micro, -(-micro // g) + (1 if micro % g else 0))
        tokens, gathered = distinct * p + micro * length, micro * (p + length) * 2 * kv * 4
    else:
        tokens, gathered = micro * (p + length), 0
    scores = micro * shape.heads * (p + length) ** 2 * 2 * 4 if shape.eager_attention else 0
    one_layer = tokens * per_token + gathered + scores
    if getattr(policy, "gradient_checkpointing", False):  # each layer's input kept, one layer's activations
        return float(shape.layers * tokens * 4 * h + one_layer)
    return float(shape.layers * one_layer)


def policy_memory_terms(shape: ModelShape, policy, prompts_per_rank: int, shards: int = 1, *,
                        eval_prompts_per_rank: int = 0, eval_generations: int = 0,
                        compress: bool = False, sampler_copy: bool = False) -> dict[str, float]:
    """One policy's memory terms on one of its workers, bytes (module docstring; docs/mwra.md, "The memory model").

    Args:
        shape: The model's shape (:func:`model_shape`).
        policy: The policy (its generation, batch and memory options are read).
        prompts_per_rank: Training prompts per step on one of its workers.
        shards: The ranks an ``fsdp`` policy is sharded over (1 otherwise).
        eval_prompts_per_rank: Held-out prompts of the largest part on one of its workers (0 =
            not counted).
        eval_generations: ``trainer.eval_num_generations`` (0 = greedy only: one completion each).
        compress: ``trainer.compress_checkpoints``.
        sampler_copy: ``trainer.async_rollouts``: a second copy of the weights samples the next batch during the
            update (docs/mwra.md, "Rollouts during the update"), so it is resident, and sampling's transient
            coexists with the update's.

    Returns:
        ``weights``, ``gradients``, ``moments``, ``reference``, ``sampler_copy`` (with ``sampler_copy``),
        ``states`` (their sum, per shard), ``activations``, ``aux_backward``, ``optimizer_step``, ``kv_cache``,
        ``eval_sampling``, ``checkpoint_write``, ``tokenizer`` and ``checkpoint``, in bytes; with ``sampler_copy`` also
        ``update_beside_sampling`` (sampling's transient plus the update's largest).
    """
    n = policy.num_generations * prompts_per_rank
    micro = min(policy.micro_batch_size or n, n)
    length = policy.max_completion_length
    trainable = shape.params if shape.trainable is None else shape.trainable
    adapter = shape.trainable is not None  # a LoRA policy: the reference is the base, no second copy
    sharded = getattr(policy, "fsdp", False) and shards > 1
    terms = {"weights": 4.0 * shape.params, "gradients": 4.0 * trainable, "moments": 8.0 * trainable,
             "reference": 4.0 * shape.params if policy.beta > 0 and not adapter else 0.0}
    for key in ("weights", "gradients", "moments", "reference"):
        terms[key] /= shards if sharded else 1  # 1/k of each on each rank of the group
    terms["states"] = terms["weights"] + terms["gradients"] + terms["moments"] + terms["reference"]
    logits = logit_elements(policy, micro, length, shape.vocab)
    copies = UPDATE_LOGIT_COPIES if logits == micro * (length + 1) * shape.vocab else CHUNK_LOGIT_COPIES
    head_gradient = 4.0 * shape.vocab * shape.hidden if shape.trainable is None else 0.0  # LoRA: the head is frozen
    terms["activations"] = _layer_bytes(shape, policy, micro) + copies * 4 * logits + head_gradient
    # a probe's loss term (SGT, PRP) backpropagates apart from the GRPO gradient, which it keeps: a second set
    # of gradients, and the activations and logits of its rows (counted as one row: SGT's few demos; PRP's
    # peer rows, up to prompts x max_peers_per_prompt in one call, are more: docs/mwra.md)
    terms["aux_backward"] = 4.0 * trainable / (shards if sharded else 1) + _layer_bytes(shape, policy, 1) \
        + head_gradient + _one_row_logits(policy, length, shape.vocab)
    # foreach AdamW: sqrt(exp_avg_sq), one per trained parameter; the fused kernel steps each tensor in place
    terms["optimizer_step"] = 0.0 if getattr(policy, "fused_optimizer", False) else terms["gradients"]
    vllm = getattr(policy, "rollout_engine", "hf") != "hf"
    gathered = 4.0 * shape.params if sharded else 0.0  # a sharded policy samples on its full weights
    terms["kv_cache"] = _sampling_bytes(shape, policy, n, vllm) + gathered
    eval_rows = eval_prompts_per_rank * max(1, eval_generations)
    terms["eval_sampling"] = _sampling_bytes(shape, policy, eval_rows, vllm) + gathered if eval_rows else 0.0
    # built after the plan (a recipe): not in the footprint measured when the plan is built
    terms["tokenizer"] = float(TOKENIZER_BYTES_PER_TOKEN * shape.vocab) if getattr(policy, "tokenizer", None) is None \
        else 0.0
    terms["checkpoint"] = float(4 * (trainable if adapter else shape.params) + 8 * trainable)
    largest = max((math.prod(v) for v in (shape.state_shapes or {}).values()), default=0)
    terms["checkpoint_write"] = terms["checkpoint"] if sharded else (2.0 * 4 * largest if compress else 0.0)
    if sampler_copy:  # the sampler view's model: a whole float32 copy (a LoRA policy's base included)
        terms["sampler_copy"] = 4.0 * shape.params
        terms["states"] += terms["sampler_copy"]
        terms["update_beside_sampling"] = terms["kv_cache"] + max(terms["activations"], terms["aux_backward"],
                                                                   terms["optimizer_step"])
    return terms


TRANSIENTS = {"activations": "update", "aux_backward": "aux. backward", "optimizer_step": "optimizer step",
              "kv_cache": "sampling", "eval_sampling": "evaluation", "checkpoint_write": "checkpoint",
              "update_beside_sampling": "update + sampling beside it"}
"""The transient terms, by the phase each belongs to (the plan's ``peak`` column)."""


def largest_transient(terms: dict[str, float], host: bool = True) -> tuple[str, float]:
    """``(phase, bytes)`` of the largest transient of :func:`policy_memory_terms` (:data:`TRANSIENTS`; the
    checkpoint write only on a CPU worker, ``host``: a GPU worker writes from host memory)."""
    counted = {k: v for k, v in terms.items() if k in TRANSIENTS and (host or k != "checkpoint_write")}
    key = max(counted, key=lambda k: counted[k])
    return TRANSIENTS[key], counted[key]


def policy_memory_parts(shape: ModelShape, policy, prompts_per_rank: int, shards: int = 1, host: bool = True,
                        **workload) -> tuple[float, float]:
    """``(states, peak transient)`` of one policy on one worker, bytes: the largest of the update's
    activations, its optimizer step, sampling, evaluation and, on a CPU worker (``host``), the
    checkpoint write (they never coexist: :func:`largest_transient`).

    Args:
        shape, policy, prompts_per_rank, shards: As :func:`policy_memory_terms`.
        host: The worker's device is the host's memory (CPU).
        **workload: ``eval_prompts_per_rank``, ``eval_generations``, ``compress`` (:func:`policy_memory_terms`).
    """
    terms = policy_memory_terms(shape, policy, prompts_per_rank, shards, **workload)
    return terms["states"], largest_transient(terms, host)[1]


def policy_memory_bytes(shape: ModelShape, policy, prompts_per_rank: int) -> float:
    """Memory of one policy on one worker while its phase runs, bytes (states + peak transient)."""
    return sum(policy_memory_parts(shape, policy, prompts_per_rank))
