"""Rollout engine on Hugging Face ``generate`` with the KV cache.

Returns completion ids, per-token log-probs under the sampling distribution, a
completion mask and the finish reason. Log-probs are computed from the raw logits
``generate`` produces, divided by ``temperature`` (the same scaling the training forward
pass uses), one step at a time while it runs (:mod:`mrl_lightning.rollout.draws`), so the
importance ratio is 1 before the first update up to float rounding. ``top_k`` / ``top_p`` truncation is not folded into these
log-probs, as in TRL; with the defaults (``top_k=0``, ``top_p=1``) they are exact.

One sampling distribution. What is sampled depends only on the policy's settings
(temperature, top_p, top_k, max_completion_length): ``generate`` gets an explicit
``GenerationConfig`` built from them alone (:func:`sampling_generation_config`, as TRL's
GRPO trainer passes its own), and the model's own ``generation_config`` (from its
``generation_config.json``) is set aside for the call. transformers merges a model's
generation config into any config passed to ``generate`` wherever the passed one leaves
a field unset, so passing a config is not enough on its own: a ``repetition_penalty``,
``no_repeat_ngram_size``, ``min_new_tokens`` or ``bad_words_ids`` there would otherwise
change the sampled tokens while the old log-probs (and the training forward) use the
plain tempered logits. When a model's own config would have changed sampling, a warning
names the model and the ignored keys, once per model and keys.

Precision. The engine runs the model as it is given, in the caller's autocast state: under
``bf16-mixed`` the loop calls it inside Fabric's autocast (the update's precision; each
weight cast once per call, docs/speed.md). Measured here on a tiny GPT-2 with large logits
(CPU bf16 autocast, T = 0.7, 24 sequences x 16 tokens): ratios 0.78-1.11 for a float32
rollout against a bf16 update; 0.96-1.05 when ``generate`` itself runs under the same
autocast (an incremental KV-cache decode and one full forward round differently in bf16);
exactly 1 when the old log-probs are the training model's own under the same autocast,
which is what the update takes (docs/rollout.md, "Correcting for the sampler").

Stops: a completion ends at the first of the policy's stop ids (EOS, every id of the
model's generation-config EOS list, its chat template's end of turn: ``stop_token_ids``),
or at the token whose text completes one of its ``stop`` strings (cut as vLLM cuts:
:mod:`mrl_lightning.rollout.stops`), finish ``stop``; only the length limit gives
``length``. Completion mask: True for every token up to and including that token. It is
built from the stop position, not from ``!= pad``, so the real stop token stays counted when
``pad_token_id == eos_token_id``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from mrl_lightning.model.forward import shared_prefix_cache
from mrl_lightning.rollout.base import RolloutBatch, left_pad
from mrl_lightning.rollout.draws import SampledLogprobs, seeded_sampling
from mrl_lightning.rollout.stops import scan_completion, stop_string_criteria
from mrl_lightning.thl import decode_completion


def completion_mask_from_eos(completion_ids: Tensor, eos_token_id: int | list[int]) -> tuple[Tensor, Tensor]:
    """Mask through the first EOS, and whether each row has one.

    Args:
        completion_ids: ``[N, L]`` int64.
        eos_token_id: One id or several.

    Returns:
        ``([N, L] bool mask, [N] bool has_eos)``.
    """
    eos_ids = torch.as_tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    is_eos = torch.isin(completion_ids, eos_ids.to(completion_ids.device))
    has_eos = is_eos.any(dim=1)
    length = completion_ids.shape[1]
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
    return positions <= first.unsqueeze(1), has_eos


# Fields of a transformers GenerationConfig that change which tokens are sampled, with the
# values that leave sampling alone (the processors transformers' ``_get_logits_processor``
# adds, and the decoding strategies other than plain sampling / greedy search).
NEUTRAL_GENERATION_VALUES: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "bad_words_ids": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "sequence_bias": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "min_p": (None, 0.0),
    "top_h": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "stop_strings": (None,),
    "num_beams": (None, 1),
    "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "constraints": (None,),
    "force_words_ids": (None,),
}
_WARNED: set[tuple[str, tuple[str, ...]]] = set()


def sampling_generation_config(
    *,
    max_new_tokens: int,
    do_sample: bool,
    temperature: float,
    top_p: float,
    top_k: int,
    pad_token_id: int,
    eos_token_id: int | list[int],
):
    """The ``transformers.GenerationConfig`` of a rollout: the policy's settings and nothing else.

    Every field that could change sampling is given its neutral value (repetition penalty
    1, no n-gram ban, no minimum length, one beam). Logits are not kept (the old log-probs
    are read one step at a time: :class:`~mrl_lightning.rollout.draws.SampledLogprobs`).

    Args:
        max_new_tokens: L, new tokens at most.
        do_sample: False = greedy search (``temperature`` / ``top_p`` / ``top_k`` unused).
        temperature: Softmax temperature (> 0).
        top_p: Nucleus threshold in (0, 1]; 1 = off.
        top_k: Top-k, 0 = off.
        pad_token_id: The tokenizer's pad id.
        eos_token_id: The tokenizer's EOS id (or ids).

    Returns:
        A ``transformers.GenerationConfig``.
    """
    from transformers import GenerationConfig

    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else {}
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=do_sample, num_beams=1, repetition_penalty=1.0,
        no_repeat_ngram_size=0, min_new_tokens=0, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        output_logits=False, return_dict_in_generate=True, **sampling,
    )


def ignored_generation_settings(model_config, *, temperature: float, top_p: float, top_k: int,
                                do_sample: bool = True) -> dict[str, Any]:
    """The fields of a model's own generation config that would change what a rollout samples.

    Args:
        model_config: The model's ``generation_config`` (or None).
        temperature: The policy's temperature.
        top_p: The policy's top_p.
        top_k: The policy's top_k (0 = off).
        do_sample: False for greedy search, where temperature / top_p / top_k play no part.

    Returns:
        ``{field: the model's value}``: sampling settings that differ from the policy's
        (when sampling), and every field of :data:`NEUTRAL_GENERATION_VALUES` set to a
        non-neutral value.
    """
    if model_config is None:
        return {}
    found = {}
    policy = (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)) if do_sample else ()
    for key, mine in policy:
        theirs = getattr(model_config, key, None)
        if theirs is not None and theirs != mine:
            found[key] = theirs
    for key, neutral in NEUTRAL_GENERATION_VALUES.items():
        value = getattr(model_config, key, None)
        if not any(value is n or value == n for n in neutral):
            found[key] = value
    return found


def _warn_once(model, ignored: dict[str, Any], policy_name: str | None) -> None:
    name = getattr(model, "name_or_path", "") or type(model).__name__
    key = (f"{policy_name}:{name}", tuple(sorted(ignored)))
    if not ignored or key in _WARNED:
        return
    _WARNED.add(key)
    who = f"policy {policy_name!r} (model {name!r})" if policy_name else f"model {name!r}"
    settings = ", ".join(f"{k}={v!r}" for k, v in sorted(ignored.items()))
    warnings.warn(f"{who}: its generation_config sets {settings}; rollouts ignore these and sample only with "
                  "the policy's temperature / top_p / top_k, the distribution the old log-probs and the loss "
                  "use. Set the policy's temperature / top_p / top_k to change sampling.", stacklevel=2)


@contextmanager
def own_settings_only(model) -> Iterator[None]:
    """Set the model's own ``generation_config`` aside (an empty one) for the block, then restore it.

    transformers fills every field a passed config leaves unset from
    ``model.generation_config``; with an empty one there, only its global defaults
    (neutral for sampling, except ``top_k=50``, which the rollout config always sets) fill in.
    """
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class _DropPaddingWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "strongly recommend passing in an `attention_mask`" not in record.getMessage()


@contextmanager
def _quiet_padding_warning() -> Iterator[None]:
    """Silence transformers' "pass an attention_mask" warning during a prefix-cached ``generate``.

    With a prefix cache, ``generate`` hands the model its 2-D mask already turned into the
    attention bias, so the model's check sees no mask and warns although padding is masked
    (the log-probs match a plain pass within 1e-5 nats on left-padded prompts; tested).
    """
    target = logging.getLogger("transformers.modeling_utils")
    flt = _DropPaddingWarning()
    target.addFilter(flt)
    try:
        yield
    finally:
        target.removeFilter(flt)


class HFGenerateEngine:
    """Sampling with ``model.generate`` (KV cache on); a :class:`~mrl_lightning.rollout.base.RolloutEngine`."""

    name = "hf_generate"

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
        share_prompt_prefill: bool = True,
        sampling_draw: str = "race",
    ) -> RolloutBatch:
        """Sample ``num_generations`` completions per prompt, with the policy's settings only.

        Args:
            model: A Hugging Face causal LM (put in eval mode for sampling, restored after).
            tokenizer: Its tokenizer (needs ``pad_token_id`` and ``eos_token_id``).
            prompt_ids: B token-id lists (already truncated to max_prompt_length).
            num_generations: G completions per prompt; rows are prompt-major (row = b*G + g).
            max_completion_length: L, max new tokens.
            temperature: Softmax temperature (> 0).
            top_p: Nucleus sampling threshold.
            top_k: Top-k (0 = off).
            do_sample: False for greedy decoding (``temperature`` then only scales log-probs).
            policy_name: Named in the warning about the model's ignored generation settings.
            weights_version: Unused: this engine samples from ``model`` itself, so it always
                has the current weights (the :class:`~mrl_lightning.rollout.base.RolloutEngine` contract).
            prompt_seeds: One seed per prompt: its G completions are drawn from that seed alone
                (:func:`seeded_sampling`), whatever else is in the batch; None = seeds drawn from
                torch's current generator.
            stop_token_ids: Ids that end a completion (finish ``stop``; the policy's EOS, its
                model's generation-config EOS list and its chat end of turn); None = the
                tokenizer's EOS.
            stop: Stop strings (vLLM ``SamplingParams.stop``): a completion ends at the token whose
                text completes one, finish ``stop``, the text cut before it; None = none
                (:mod:`mrl_lightning.rollout.stops`).
            include_stop_str_in_output: Keep the matched stop string in the text (vLLM's option).
            share_prompt_prefill: Run each prompt once and share its KV cache across its
                G rows (:func:`mrl_lightning.model.forward.shared_prefix_cache`); False = one plain
                ``generate`` over the B*G rows.
            sampling_draw: ``race`` or ``inverse_cdf``: how each token is drawn from its prompt's
                seed (:mod:`mrl_lightning.rollout.draws`; one distribution, other draws).

        Returns:
            :class:`RolloutBatch` with N = B * G rows.

        Raises:
            ValueError: empty prompt list, temperature <= 0, or not one seed per prompt.
        """
        from transformers import LogitsProcessorList

        if not prompt_ids:
            raise ValueError("prompt_ids is empty; nothing to generate.")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0.")
        stops = list(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
        repeated = [p for p in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, tokenizer.pad_token_id)
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        was_training = model.training
        model.eval()
        # Sampling is an exponential race drawn per prompt from its own seed (seeded_sampling), so
        # generate itself runs its greedy search over the tempered, filtered, perturbed scores.
        config = sampling_generation_config(
            max_new_tokens=max_completion_length, do_sample=False, temperature=temperature, top_p=top_p,
            top_k=top_k, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops,
        )
        record = SampledLogprobs(None if do_sample else temperature)  # the sampled tokens' log-probs, step by step
        processors = seeded_sampling(prompt_seeds, len(prompt_ids), num_generations, temperature, top_p, top_k,
                                     sampling_draw, record) if do_sample else LogitsProcessorList([record])
        ignored = ignored_generation_settings(getattr(model, "generation_config", None), temperature=temperature,
                                              top_p=top_p, top_k=top_k, do_sample=do_sample)
        _warn_once(model, ignored, policy_name)
        try:
            with own_settings_only(model):
                prefix = {}
                if share_prompt_prefill:
                    u_ids, u_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
                    prefix = shared_prefix_cache(model, u_ids.to(device), u_mask.to(device), num_generations)
                with _quiet_padding_warning():
                    # synced_gpus off: transformers turns it on for an FSDP model and then all-reduces on the
                    # default group at every token, which hangs when the policy's group is not every rank;
                    # a sharded policy generates from its full weights (mwra/sharding.py full_weights)
                    criteria = [stop_string_criteria(tokenizer, stop, ids.shape[0], include_stop_str_in_output)] \
                        if stop else None
                    out = model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=config,
                                         logits_processor=processors, stopping_criteria=criteria, synced_gpus=False,
                                         **prefix)
        finally:
            model.train(was_training)
        completion = out.sequences[:, ids.shape[1]:]
        # read during generate, one step's [N, V] scores at a time, not from [N, L, V] kept logits (rollout/draws.py)
        logp = record.logprobs(completion)  # [N, L]
        if stop:  # where each row's text completes a stop string, or its first stop id (rollout/stops.py)
            scans = [scan_completion(tokenizer, row, stops, stop, include_stop_str_in_output)
                     for row in completion.tolist()]
            cmask = torch.arange(completion.shape[1], device=completion.device).unsqueeze(0) < torch.tensor(
                [s.length for s in scans], device=completion.device).unsqueeze(1)
            has_eos, reasons = torch.tensor([s.stopped for s in scans]), [s.stop_reason for s in scans]
        else:
            cmask, has_eos = completion_mask_from_eos(completion, stops)
            scans, reasons = None, _stop_ids_at_end(completion, cmask, has_eos)
        # Rows that finished early were filled with pad; never count those positions.
        logp = torch.where(cmask, logp, torch.zeros_like(logp))
        completion = torch.where(cmask, completion, torch.full_like(completion, tokenizer.pad_token_id))
        # Exact text (THL): keeps a leading space that SentencePiece's decode would strip;
        # EOS and other specials contribute nothing; a cut character becomes U+FFFD.
        texts, decoded = [], {}  # a group often repeats a completion: decode each distinct one once
        for i, (row, counted) in enumerate(zip(completion.tolist(), cmask.tolist())):
            key = tuple(t for t, m in zip(row, counted) if m)
            if scans is not None and scans[i].text is not None:  # cut at its stop string
                texts.append(scans[i].text)
                continue
            if key not in decoded:
                decoded[key] = decode_completion(tokenizer, list(key), errors="replace")
            texts.append(decoded[key])
        return RolloutBatch(
            prompt_ids=ids, prompt_mask=mask, completion_ids=completion, completion_mask=cmask,
            old_logprobs=logp, finish_reasons=["stop" if e else "length" for e in has_eos.tolist()],
            completion_texts=texts, stop_reasons=reasons,
        )


def _stop_ids_at_end(completion: Tensor, cmask: Tensor, has_eos: Tensor) -> list[int | None]:
    """Each row's stop reason without stop strings: the stop id it ended with, or None (length)."""
    last = cmask.sum(dim=1) - 1
    ends = completion.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1).tolist()
    return [int(e) if h else None for e, h in zip(ends, has_eos.tolist())]
