"""Rollout engine on Hugging Face ``generate`` with the KV cache (SPEC 1 step 2).

Returns completion ids, per-token log-probs under the sampling distribution, a
completion mask and the finish reason. Log-probs are computed from the raw logits
``generate`` already produced, divided by ``temperature`` (the same scaling the
training forward pass uses), so the importance ratio is 1 before the first update up
to float rounding. ``top_k`` / ``top_p`` truncation is not folded into these
log-probs, as in TRL; with the defaults (``top_k=0``, ``top_p=1``) they are exact.

Completion mask: True for every token up to and including the first EOS. It is built
from the EOS position, not from ``!= pad``, so the real EOS stays counted when
``pad_token_id == eos_token_id``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mrl_lightning.thl import decode_completion


@dataclass
class RolloutBatch:
    """Sampled completions of one policy for one step.

    Shapes: N = B*G sequences, P prompt length (left-padded), L completion length.

    Attributes:
        prompt_ids: ``[N, P]`` int64, left-padded.
        prompt_mask: ``[N, P]`` bool, True = real prompt token.
        completion_ids: ``[N, L]`` int64, right-padded with the pad id.
        completion_mask: ``[N, L]`` bool, True = counted (through the first EOS).
        old_logprobs: ``[N, L]`` float32 nats under the sampling distribution (0 where masked).
        finish_reasons: N strings, "eos" or "length".
        completion_texts: N decoded texts (special tokens removed).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor
    finish_reasons: list[str]
    completion_texts: list[str]

    @property
    def truncated(self) -> Tensor:
        """``[N]`` bool, True where generation stopped at max length without EOS."""
        return torch.tensor([r == "length" for r in self.finish_reasons], dtype=torch.bool)


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


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token id lists.

    Returns:
        ``([N, P] int64 ids, [N, P] bool mask)``.
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = True
    return ids, mask


class HFGenerateEngine:
    """Sampling with ``model.generate`` (KV cache on)."""

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
    ) -> RolloutBatch:
        """Sample ``num_generations`` completions per prompt.

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

        Returns:
            :class:`RolloutBatch` with N = B * G rows.

        Raises:
            ValueError: empty prompt list or temperature <= 0.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty; nothing to generate.")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0.")
        repeated = [p for p in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, tokenizer.pad_token_id)
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        was_training = model.training
        model.eval()
        kwargs = dict(do_sample=do_sample, max_new_tokens=max_completion_length,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      output_logits=True, return_dict_in_generate=True)
        if do_sample:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        out = model.generate(input_ids=ids, attention_mask=mask.long(), **kwargs)
        model.train(was_training)
        completion = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [N, L, V]
        logp = torch.gather(logits, 2, completion.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        cmask, has_eos = completion_mask_from_eos(completion, tokenizer.eos_token_id)
        # Rows that finished early were filled with pad; never count those positions.
        logp = torch.where(cmask, logp, torch.zeros_like(logp))
        completion = torch.where(cmask, completion, torch.full_like(completion, tokenizer.pad_token_id))
        # Exact text (THL): keeps a leading space that SentencePiece's decode would strip;
        # EOS and other specials contribute nothing; a cut character becomes U+FFFD.
        texts = [decode_completion(tokenizer, row[m].tolist(), errors="replace") for row, m in zip(completion, cmask)]
        return RolloutBatch(
            prompt_ids=ids, prompt_mask=mask, completion_ids=completion, completion_mask=cmask,
            old_logprobs=logp, finish_reasons=["eos" if e else "length" for e in has_eos.tolist()],
            completion_texts=texts,
        )
