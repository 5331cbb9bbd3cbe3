"""Rollout engine on vLLM, behind the contract of the Hugging Face engine (docs/rollout.md).

:class:`VLLMEngine` returns the same :class:`~mrl_lightning.rollout.RolloutBatch` as
:class:`~mrl_lightning.rollout.HFGenerateEngine` (prompt ids and mask, completion ids
and mask through the first stop token, per-token log-probs, finish reasons, exact texts),
plus ``sampling_logprobs``: the log-probs vLLM reported for the tokens it sampled. The
update re-scores the rollouts with the training model and corrects the remaining
sampler/trainer mismatch with bounded importance weights
(:mod:`mrl_lightning.rollout.sampler_correction`).

One sampling distribution. vLLM gets an explicit ``SamplingParams`` holding the policy's
temperature / top_p / top_k, the completion length and nothing else (every penalty at its
neutral default), so the model's ``generation_config.json`` never changes what is sampled;
its ``eos_token_id`` list still ends a completion, as it does in vLLM. Log-probs come from
the distribution that was sampled: the engine is built with
``logprobs_mode="processed_logprobs"`` (read in vLLM 0.32 / 0.33; the default
``raw_logprobs`` would report the untempered model), i.e. ``log_softmax`` of the logits after temperature and
top-k / top-p, the same thing the Hugging Face engine computes as ``log_softmax(logits / T)``
when top-k / top-p are off.

Weights. Before every generation the engine compares the training model's parameters
(their storage and in-place version counters, which ``load_state_dict``, ``copy_`` and
the for-loop and foreach optimizers advance, plus the policy's count of optimizer steps, passed as
``weights_version``, since a fused optimizer advances no version counter) with those it last pushed; when they differ it pushes every
parameter and resets vLLM's prefix cache, whose prompt KV blocks were computed with the old
weights. Sampling never sees stale weights, and several optimizer steps between two rollouts
cost one push. Colocated, the push is vLLM's own in-place reload, ``collective_rpc("reload_weights",
weights_iterator=..., is_checkpoint_format=True)`` (:class:`ColocatedVLLM`), on a CUDA and a
CPU build alike; a server gets the weights over its NCCL weight-transfer engine through TRL's
client.

Backends (``vllm_mode``): ``colocate`` builds ``vllm.LLM`` in this process on the policy's
GPU (``distributed_executor_backend="external_launcher"``, as TRL's colocated mode) with a
memory share taken from the MWRA plan (:func:`~mrl_lightning.builders.engines.colocated_memory_share`)
unless ``vllm_gpu_memory_utilization`` is set; ``server`` talks to a ``trl vllm-serve``
server (its ``VLLMClient``). Both are built by :func:`~mrl_lightning.builders.engines.build_vllm_engine`;
tests run it against vLLM's CPU build (``tests/real_vllm``) and, for what a CPU build cannot
show (server mode, NCCL), an in-process double of the same few calls (docs/rollout.md).

Seeds: one per prompt, the loop's ``prompt_seeds`` (keyed by run seed, policy, step and the
prompt's place in the step's batch, so the rank that samples a prompt does not matter), or
else ``base + b*G`` with ``base`` drawn from torch's generator; vLLM gives completion g of a
request ``seed + g``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mrl_lightning.rollout.base import RolloutBatch, left_pad
from mrl_lightning.rollout.stops import Scan, scan_completion
from mrl_lightning.thl import decode_completion

# vLLM's finish reasons (vllm.v1.engine.FINISH_REASON_STRINGS) -> the rollout contract's.
FINISH_REASONS = {"stop": "stop", "length": "length"}
_SEED_RANGE = 2**31 - 1


@dataclass
class Sample:
    """One completion as a backend returns it.

    Attributes:
        token_ids: ``[L_i]`` sampled ids, the stop token included when it ended the completion.
        logprobs: ``[L_i]`` float nats of each sampled token (processed log-probs).
        finish_reason: vLLM's reason: ``"stop"`` or ``"length"`` (anything else is an error).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


class Backend(Protocol):
    """What :class:`VLLMEngine` needs from vLLM (colocated ``LLM`` or a server client)."""

    def sample(self, prompt_ids: list[list[int]], n: int, seeds: list[int], temperature: float, top_p: float,
               top_k: int, max_tokens: int, stop_ids: list[int], stop: list[str] | None = None,
               include_stop_str_in_output: bool = False) -> list[list[Sample]]: ...

    def push_weights(self, model: torch.nn.Module) -> None: ...


def weights_key(model: torch.nn.Module, version: int = 0) -> tuple:
    """Identity of a model's current weights: the policy's optimizer-step count, each parameter's storage and version.

    An in-place change through autograd-visible ops (``load_state_dict``, ``copy_``, the
    for-loop and foreach optimizers) advances a tensor's version counter, a replaced tensor
    has new storage, and ``version`` (the policy's
    :attr:`~mrl_lightning.policy.PolicyModule.optimizer_steps_taken`) counts the steps of any
    optimizer, so two equal keys mean no parameter changed in between.
    """
    return version, tuple((p.data_ptr(), p._version) for p in model.parameters())


@contextmanager
def pushable_parameters(model: torch.nn.Module) -> Iterator[list[tuple[str, Tensor]]]:
    """``(name, tensor)`` of the weights vLLM holds, under the base model's names.

    A plain model's parameters as they are, every name of a shared tensor included (a tied LM
    head comes as ``lm_head.weight`` beside the embedding's name: vLLM may hold it apart, see
    :class:`ColocatedVLLM`). For a LoRA (peft) model each adapted layer's
    weight is sent merged, ``W + alpha / r * B A`` (peft's ``get_delta_weight`` of every active
    adapter), computed beside the base weight, which is never touched (merging into it and
    unmerging after every push would let float rounding walk the frozen base away); the names
    lose peft's ``base_model.model.`` prefix and ``.base_layer`` infix, ``modules_to_save`` give
    their trained copy, and the adapter's own matrices are not sent: vLLM serves the merged
    model, no adapter (its LoRA serving loads adapters from files per request, which a push
    after every optimizer step cannot use).
    """
    if not hasattr(model, "peft_config"):
        yield [(name, p.data) for name, p in model.named_parameters(remove_duplicate=False)]
        return
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        merged = {}
        for module_name, module in model.named_modules():
            if isinstance(module, LoraLayer) and hasattr(module, "base_layer"):
                delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
                merged[f"{module_name}.base_layer.weight"] = module.base_layer.weight.data + delta
        out = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if ".lora_" in name or ".original_module." in name:
                continue
            tensor = merged.get(name, p.data)
            name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            out.append((name.replace(".modules_to_save.default.", "."), tensor))
        yield out


class _NothingToLoadNotice(logging.Filter):
    """Drops the reload warning of rotary-embedding layers ("RotaryEmbedding: Failed to load
    weights", ``finalize_layerwise_processing``): they hold only a cos/sin cache computed at
    start-up, which no checkpoint holds and vLLM puts back unchanged. Logged at every push of
    a Llama-like model otherwise; every other reload warning passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and str(record.args[0]).endswith("RotaryEmbedding"))


def _quiet_rotary_reload() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _NothingToLoadNotice) for f in logger.filters):
        logger.addFilter(_NothingToLoadNotice())


def _engine_dtype(worker) -> torch.dtype:
    """Run inside vLLM's worker (``collective_rpc``): the dtype vLLM holds the weights in."""
    return worker.model_runner.model_config.dtype


class ColocatedVLLM:
    """Backend on an in-process ``vllm.LLM`` (or a double with the same calls).

    Args:
        llm: A ``vllm.LLM`` built with ``logprobs_mode="processed_logprobs"`` and an
            in-process executor (``external_launcher``).
        sampling_params_cls: ``vllm.SamplingParams``.

    Weight push (:meth:`push_weights`): ``llm.collective_rpc("reload_weights", kwargs=
    {"weights_iterator": <(hf_name, tensor) pairs>, "is_checkpoint_format": True})``, vLLM's
    ``Worker.reload_weights`` -> ``GPUModelRunner.reload_weights`` (the CPU runner inherits it)
    -> ``model_loader/reload/inplace.py: reload_weights``, the same code in vLLM 0.32.0 and
    0.33.0: every layer is put back into checkpoint format, the model's own ``load_weights``
    maps the Hugging Face names (fused qkv / gate_up, GPT-2's transposed Conv1D), and each
    layer, once all its weights arrived, is processed again as at start-up and copied into its
    original tensors, which keeps CUDA graphs valid (``reload/layerwise.py``). The model
    runner's ``model.load_weights`` alone (TRL 1.16's colocated path) skips that processing:
    on vLLM's CPU build, which repacks linear weights after loading and leaves 0-size
    parameters behind, it fails ("Attempted to load weight (torch.Size([128, 256])) into
    parameter (torch.Size([0]))").

    A tied LM head is sent under its own name too (:func:`pushable_parameters`): vLLM unties a
    head whose checkpoint holds ``lm_head.weight`` (``ModelConfig.maybe_untie_word_embeddings``;
    ``save_pretrained`` of a tied Llama can write only that name), and a tied head that loads
    nothing is not processed again (on the CPU build it keeps its packed copy of the old
    weight: measured 8-19 nats off). Tensors are cast to vLLM's dtype one at a time as the
    reload reads them (else vLLM logs a warning per tensor per push under ``vllm_dtype:
    bfloat16``). The executor is in-process: nothing is serialized or copied beyond that cast.
    Then the prefix cache is reset.
    """

    def __init__(self, llm: Any, sampling_params_cls: Any) -> None:
        self.llm, self.sampling_params_cls = llm, sampling_params_cls
        self.dtype = llm.collective_rpc(_engine_dtype)[0]
        _quiet_rotary_reload()

    def sample(self, prompt_ids, n, seeds, temperature, top_p, top_k, max_tokens, stop_ids, stop=None,
               include_stop_str_in_output=False) -> list[list[Sample]]:
        # stop_token_ids: vLLM ends a request at any of them with finish "stop" and keeps the
        # token in the output ids (it does so for EOS and generation-config EOS ids alike).
        # stop: vLLM's output processor cuts the text at the first stop string and keeps the token
        # ids through the one that completed it (rollout/stops.py).
        strings = dict(stop=list(stop), include_stop_str_in_output=include_stop_str_in_output) if stop else {}
        params = [self.sampling_params_cls(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                           max_tokens=max_tokens, logprobs=0, seed=seed,
                                           stop_token_ids=list(stop_ids), **strings) for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False)
        out = []
        for request in outputs:
            rows = []
            for c in sorted(request.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                rows.append(Sample(ids, [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)], c.finish_reason))
            out.append(rows)
        return out

    def push_weights(self, model: torch.nn.Module) -> None:
        with pushable_parameters(model) as params:  # references to the trainer's tensors (merged ones for LoRA)
            cast = ((name, tensor.to(self.dtype)) for name, tensor in params)  # one tensor at a time
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def named_parameters(self) -> dict[str, Tensor]:
        """vLLM's own parameters by its names (fused ``qkv_proj`` / ``gate_up_proj``; on the CPU
        build repacked linear weights show as 0-size tensors). For checks, not for the loop."""
        return self.llm.collective_rpc(lambda worker: dict(worker.model_runner.get_model().named_parameters()))[0]


class ServerVLLM:
    """Backend on a ``trl vllm-serve`` server through TRL's ``VLLMClient`` (or a double).

    Args:
        client: A connected ``trl.generation.vllm_client.VLLMClient`` whose weight-transfer
            communicator is initialised.
        stop_ids: Token ids that end a completion (the tokenizer's EOS), to tell a stopped
            completion from a truncated one: the server's completions carry no finish reason.
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    def sample(self, prompt_ids, n, seeds, temperature, top_p, top_k, max_tokens, stop_ids, stop=None,
               include_stop_str_in_output=False) -> list[list[Sample]]:
        stops = set(stop_ids)
        strings = dict(stop=list(stop), include_stop_str_in_output=include_stop_str_in_output) if stop else {}
        out = []
        for ids, seed in zip(prompt_ids, seeds):  # one request per prompt: its own seed, as colocated
            reply = self.client.generate(prompts=[list(ids)], n=n, repetition_penalty=1.0, temperature=temperature,
                                         top_p=top_p, top_k=top_k, min_p=0.0, max_tokens=max_tokens, logprobs=0,
                                         generation_kwargs={"seed": seed, "stop_token_ids": sorted(stops),
                                                            **strings})
            rows = []
            for tokens, lps, lp_ids in zip(reply["completion_ids"], reply["logprobs"], reply["logprob_token_ids"]):
                chosen = [lp[ids_t.index(tok)] for tok, lp, ids_t in zip(tokens, lps, lp_ids)]
                # the server's reply carries no finish reason (a stop string's is found by the engine's scan)
                stopped = bool(tokens) and tokens[-1] in stops
                rows.append(Sample(list(tokens), chosen, "stop" if stopped else "length"))
            out.append(rows)
        return out

    def push_weights(self, model: torch.nn.Module) -> None:
        # One weight update for the whole model (TRL's update_named_params: the server starts its
        # layerwise reload once, receives every tensor, then finishes). A tensor sent in an update
        # of its own (update_named_param outside client.weight_update()) would leave the rest of
        # its vLLM layer uninitialised: k and v of a fused qkv_proj when only q arrives
        # (vLLM 0.32 / 0.33 reload/layerwise.py, "Delayed processing"). Names and tensors as
        # colocated: a LoRA policy's merged weights, a tied head under its own name too.
        with pushable_parameters(model) as params:
            metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in params]
            self.client.update_named_params(metadata, iter(params))
        self.client.reset_prefix_cache()


class VLLMEngine:
    """Sampling with vLLM; a :class:`~mrl_lightning.rollout.base.RolloutEngine` like the Hugging Face engine.

    Args:
        backend: :class:`ColocatedVLLM` or :class:`ServerVLLM`.

    Attributes:
        pushes: Weight pushes so far.
        last_push_s: Wall time of the last push, seconds.
    """

    name = "vllm"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._pushed: tuple | None = None
        self.pushes, self.last_push_s = 0, 0.0

    def sync_weights(self, model: torch.nn.Module, version: int = 0) -> bool:
        """Push the model's weights to vLLM when they changed since the last push.

        Args:
            model: The training model.
            version: The policy's optimizer-step count (:func:`weights_key`).

        Returns:
            True when weights were pushed.
        """
        key = weights_key(model, version)
        if key == self._pushed:
            return False
        start = time.perf_counter()
        self.backend.push_weights(model)
        self._pushed = weights_key(model, version)
        self.pushes += 1
        self.last_push_s = time.perf_counter() - start
        return True

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        tokenizer,
        prompt_ids: list[list[int]],
        *,
        num_generations: int,
        max_completion_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        policy_name: str | None = None,
        weights_version: int = 0,
        prompt_seeds: list[int] | None = None,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        **_: Any,
    ) -> RolloutBatch:
        """Sample ``num_generations`` completions per prompt with the policy's settings only.

        Args:
            model: The training model (its current weights are pushed first if they changed).
            tokenizer: Its tokenizer (pad id for padding, exact decoding of the texts).
            prompt_ids: B token-id lists (already truncated to max_prompt_length).
            num_generations: G completions per prompt; rows are prompt-major (row = b*G + g).
            max_completion_length: L, max new tokens.
            temperature: Softmax temperature (> 0).
            top_p: Nucleus threshold in (0, 1]; 1 = off.
            top_k: Top-k; 0 = off.
            do_sample: False = greedy (vLLM's temperature 0; one completion per prompt, repeated).
            policy_name: Named in errors.
            weights_version: The policy's optimizer-step count: weights are pushed when it or
                the parameters changed since the last push (:func:`weights_key`).
            prompt_seeds: One seed per prompt (vLLM seeds completion g of a request ``seed + g``);
                None = ``base + b*G`` with ``base`` drawn from torch's current generator.
            stop_token_ids: Ids that end a completion with finish ``stop`` (passed to vLLM as
                ``stop_token_ids``); None = the tokenizer's EOS.
            stop: Stop strings (vLLM ``SamplingParams.stop``); the completion is cut where vLLM cuts it,
                the same rules replayed on the returned ids (:func:`~mrl_lightning.rollout.stops.scan_completion`),
                so server mode, whose reply has no text, cuts alike; None = none.
            include_stop_str_in_output: Keep the matched stop string in the text (vLLM's option).

        Returns:
            :class:`~mrl_lightning.rollout.base.RolloutBatch` with N = B * G rows, tensors on the model's device;
            ``old_logprobs`` and ``sampling_logprobs`` ``[N, L]`` float32 nats.

        Raises:
            ValueError: empty prompt list, temperature <= 0, or not one seed per prompt.
            RuntimeError: vLLM ended a completion for a reason other than a stop token or the
                length limit (an aborted or failed request), naming the policy and the reason.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; nothing to generate.")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0.")
        self.sync_weights(model, weights_version)
        n = num_generations if do_sample else 1
        if prompt_seeds is not None:
            if len(prompt_seeds) != len(prompt_ids):
                raise ValueError(f"prompt_seeds has {len(prompt_seeds)} seeds for {len(prompt_ids)} prompts; give one "
                                 "per prompt.")
            seeds = [int(x) % (_SEED_RANGE - n) for x in prompt_seeds]
        else:
            base = int(torch.randint(0, _SEED_RANGE - len(prompt_ids) * n, (1,)))
            seeds = [base + b * n for b in range(len(prompt_ids))]
        stops = list(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
        strings = dict(stop=list(stop), include_stop_str_in_output=include_stop_str_in_output) if stop else {}
        samples = self.backend.sample(prompt_ids, n, seeds, temperature if do_sample else 0.0,
                                      top_p if do_sample else 1.0, top_k if do_sample else 0, max_completion_length,
                                      stops, **strings)
        if not do_sample:
            samples = [rows * num_generations for rows in samples]
        return self._batch(model, tokenizer, prompt_ids, samples, num_generations, policy_name, stops, strings)

    @staticmethod
    def _batch(model, tokenizer, prompt_ids, samples, num_generations, policy_name, stops, strings) -> RolloutBatch:
        rows = [s for per_prompt in samples for s in per_prompt]
        for s in rows:
            if s.finish_reason not in FINISH_REASONS:
                who = f"policy {policy_name!r}: " if policy_name else ""
                raise RuntimeError(f"{who}vLLM ended a completion with finish_reason={s.finish_reason!r} (not a stop "
                                   "token or the length limit); the request was aborted or failed, see vLLM's log.")
        cut = [_cut(tokenizer, s, stops, strings) for s in rows]
        rows = [s for s, _ in cut]
        device = next(model.parameters()).device
        ids, mask = left_pad([p for p in prompt_ids for _ in range(num_generations)], tokenizer.pad_token_id)
        length = max(1, max(len(s.token_ids) for s in rows))
        completion = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
        cmask = torch.zeros((len(rows), length), dtype=torch.bool)
        logp = torch.zeros((len(rows), length), dtype=torch.float32)
        for i, s in enumerate(rows):
            k = len(s.token_ids)
            completion[i, :k] = torch.tensor(s.token_ids, dtype=torch.long)
            cmask[i, :k] = True
            logp[i, :k] = torch.tensor(s.logprobs, dtype=torch.float32)
        texts = [scan.text if scan is not None and scan.text is not None
                 else decode_completion(tokenizer, s.token_ids, errors="replace") for s, scan in cut]
        return RolloutBatch(
            prompt_ids=ids.to(device), prompt_mask=mask.to(device), completion_ids=completion.to(device),
            completion_mask=cmask.to(device), old_logprobs=logp.clone().to(device),
            finish_reasons=[FINISH_REASONS[s.finish_reason] for s in rows], completion_texts=texts,
            sampling_logprobs=logp.to(device),
            stop_reasons=[_stop_reason(s, scan) for s, scan in cut],
        )


def _stop_reason(sample: Sample, scan: Scan | None) -> int | str | None:
    """vLLM's ``stop_reason``: the matched stop string or stop id, the last id of a "stop" row, or None."""
    if scan is not None and scan.stopped:
        return scan.stop_reason
    return int(sample.token_ids[-1]) if sample.finish_reason == "stop" and sample.token_ids else None


def _cut(tokenizer, sample: Sample, stops: list[int], strings: dict) -> tuple[Sample, Scan | None]:
    """A sample cut at its stop string as vLLM cuts it (:func:`~mrl_lightning.rollout.stops.scan_completion`):
    through the token that completed it, finish "stop"; unchanged (and no scan) without stop strings."""
    if not strings:
        return sample, None
    scan = scan_completion(tokenizer, sample.token_ids, stops, strings["stop"], strings["include_stop_str_in_output"])
    if not scan.stopped:
        return sample, scan
    return Sample(sample.token_ids[:scan.length], sample.logprobs[:scan.length], "stop"), scan
