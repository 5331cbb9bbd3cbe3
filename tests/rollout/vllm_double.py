"""An in-process double of exactly the parts of vLLM (0.32 / 0.33) and TRL's ``VLLMClient``
(1.16) that :mod:`mrl_lightning.rollout.vllm_engine` calls. Test code only: it is not
importable as ``vllm`` and production code never imports it.

What is modelled, from vLLM's source:

- ``SamplingParams``: keyword-only, unknown keywords raise ``TypeError`` (a msgspec
  struct); temperature < 1e-5 means greedy and then needs ``n == 1``; ``top_k`` 0 or -1
  = off; ``seed``: completion ``i`` of a request samples with ``seed + i``
  (``vllm/v1/engine/parallel_sampling.py``).
- ``LLM(model, ..., logprobs_mode="raw_logprobs")``: ``generate(prompts, params, use_tqdm)``
  with prompts ``{"prompt_token_ids": [...]}`` and one params object or one per prompt;
  per step: float32 logits -> ``raw`` log-probs -> temperature -> top-k -> top-p ->
  sample; ``processed_logprobs`` = ``log_softmax`` of the processed logits
  (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``). The EOS token ends a
  completion and stays in ``token_ids`` (``finish_reason="stop"``), and so does any id of
  ``stop_token_ids`` (``check_stop`` appends the sampled token before it compares); ``max_tokens``
  gives ``"length"`` (``vllm/v1/core/sched/utils.py``). Returned ``logprobs`` hold the sampled
  token per position (``logprobs=0``).
- The prefix cache: a prompt's KV is computed once and reused until
  ``reset_prefix_cache()``, even after the weights change, as vLLM's block cache does.
- ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(pairs)``
  copies Hugging Face-named tensors into the engine's own copy of the model and raises
  ``KeyError`` on an unknown name.
- ``VLLMClient``: ``generate(...)`` returns ``prompt_ids`` / ``completion_ids`` /
  ``logprobs`` / ``logprob_token_ids``; ``get_server_info()["model_config"]["logprobs_mode"]``;
  ``update_model_params(model)``; ``update_named_param(name, weights)``; ``reset_prefix_cache()``.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

SAMPLING_EPS = 1e-5


class FakeSamplingParams:
    """The fields of ``vllm.SamplingParams`` the engine may pass, with vLLM's defaults."""

    def __init__(self, *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 max_tokens: int | None = 16, logprobs: int | None = None, seed: int | None = None,
                 repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 min_p: float = 0.0, min_tokens: int = 0, stop_token_ids: list[int] | None = None) -> None:
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.logprobs, self.seed = max_tokens, logprobs, seed
        self.repetition_penalty, self.presence_penalty, self.frequency_penalty = (
            repetition_penalty, presence_penalty, frequency_penalty)
        self.min_p, self.min_tokens = min_p, min_tokens
        self.stop_token_ids = list(stop_token_ids or [])
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if temperature < SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {n}.")


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


@dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput] = field(default_factory=list)


class _RunnerModel:
    """vLLM's model object as far as ``load_weights`` goes."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf = hf_model
        self.loaded = 0

    def named_parameters(self):
        return self.hf.named_parameters()

    def load_weights(self, weights) -> set[str]:
        params = dict(self.hf.named_parameters())
        done = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)  # KeyError on a name the model does not have
            done.add(name)
            self.loaded += 1
        return done


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


class FakeLLM:
    """``vllm.LLM`` sampling from a tiny Hugging Face model loaded from ``model``.

    Attributes:
        init_kwargs: The keyword arguments the engine built it with.
        calls: Every ``generate`` call's sampling params (list per call).
    """

    def __init__(self, model: str, *, logprobs_mode: str = "raw_logprobs", enable_prefix_caching: bool = True,
                 **kwargs) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.init_kwargs = dict(model=model, logprobs_mode=logprobs_mode, **kwargs)
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or model)
        self.logprobs_mode, self.prefix_caching = logprobs_mode, enable_prefix_caching
        self.runner_model = _RunnerModel(self.hf)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.runner_model))))
        self._prefix: dict[tuple[int, ...], tuple] = {}
        self.calls: list[list[FakeSamplingParams]] = []
        self.resets = 0

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self._prefix.clear()
        self.resets += 1
        return True

    @torch.no_grad()
    def _prompt_state(self, ids: list[int]):
        key = tuple(ids)
        if self.prefix_caching and key in self._prefix:
            logits, cache = self._prefix[key]
        else:
            out = self.hf(input_ids=torch.tensor([ids]), use_cache=True)
            logits, cache = out.logits[0, -1].float(), _cache_of(out)
            if self.prefix_caching:
                self._prefix[key] = (logits, cache)
        return logits.clone(), copy.deepcopy(cache)

    @torch.no_grad()
    def _complete(self, ids: list[int], params: FakeSamplingParams, index: int) -> FakeCompletionOutput:
        gen = torch.Generator().manual_seed(params.seed + index) if params.seed is not None else None
        logits, cache = self._prompt_state(ids)
        eos = self.tokenizer.eos_token_id
        tokens, lps, finish = [], [], "length"
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
            if token == eos or token in params.stop_token_ids:  # kept in token_ids, as vLLM's check_stop
                finish = "stop"
                break
            out = self.hf(input_ids=torch.tensor([[token]]), use_cache=True, **{_cache_arg(self.hf): cache})
            logits, cache = out.logits[0, -1].float(), _cache_of(out)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        logprobs = [{t: Logprob(lp, None, None)} for t, lp in zip(tokens, lps)] if params.logprobs is not None else None
        return FakeCompletionOutput(index, text, tuple(tokens), sum(lps), logprobs, finish)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs) -> list[FakeRequestOutput]:
        if sampling_params is None:
            sampling_params = FakeSamplingParams()
        many = isinstance(sampling_params, (list, tuple))
        params = list(sampling_params) if many else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
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

    def update_model_params(self, model: torch.nn.Module) -> None:
        self.llm.runner_model.load_weights((name, p.data) for name, p in model.named_parameters())

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        self.llm.runner_model.load_weights([(name, weights)])

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
