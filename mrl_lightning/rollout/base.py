"""What every rollout engine returns and the one call it answers (docs/rollout.md).

Shapes: B prompts, G = ``num_generations``, N = B*G rows (prompt-major: row = b*G + g),
P prompt length (left-padded), L completion length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """Sampled completions of one policy for one step.

    Attributes:
        prompt_ids: ``[N, P]`` int64, left-padded.
        prompt_mask: ``[N, P]`` bool, True = real prompt token.
        completion_ids: ``[N, L]`` int64, right-padded with the pad id.
        completion_mask: ``[N, L]`` bool, True = counted (through the first stop token, or the token
            whose text completed a stop string).
        old_logprobs: ``[N, L]`` float32 nats under the sampling distribution (0 where masked).
        finish_reasons: N strings, "stop" (ended at a stop token: EOS, the model's
            generation-config EOS list, the chat end of turn; or at a stop string) or "length"
            (the length limit).
        completion_texts: N decoded texts (special tokens removed; cut before a matched stop string).
        sampling_logprobs: ``[N, L]`` float32 nats when the sampler's log-probs must be
            re-scored by the update (another engine, or mixed precision); None = the old
            log-probs are the update's own.
        stop_reasons: N entries, as vLLM's ``stop_reason``: the stop string a "stop" row matched
            (:mod:`mrl_lightning.rollout.stops`) or the stop id it ended with (EOS's id too, where vLLM
            reports None), None for "length"; None = not recorded.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor
    finish_reasons: list[str]
    completion_texts: list[str]
    sampling_logprobs: Tensor | None = None
    stop_reasons: list[int | str | None] | None = None

    @property
    def truncated(self) -> Tensor:
        """``[N]`` bool, True where generation stopped at max length without a stop token."""
        return torch.tensor([r == "length" for r in self.finish_reasons], dtype=torch.bool)

    def select_rows(self, rows: list[int]) -> RolloutBatch:
        """The rows ``rows`` (in that order), at this batch's widths."""
        index = torch.tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t[index.to(t.device)]  # noqa: E731
        return RolloutBatch(pick(self.prompt_ids), pick(self.prompt_mask), pick(self.completion_ids),
                            pick(self.completion_mask), pick(self.old_logprobs),
                            [self.finish_reasons[i] for i in rows], [self.completion_texts[i] for i in rows],
                            pick(self.sampling_logprobs))


def concat_rollouts(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """The rows of ``parts`` one after another: prompts left-padded and completions right-padded to the widest.

    Padding is what each batch has already: prompt and completion ids ``pad_id``, masks False,
    log-probs 0. ``sampling_logprobs`` is kept when every part has it.

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("concat_rollouts needs at least one RolloutBatch.")
    if len(parts) == 1:
        return parts[0]
    width_p = max(x.prompt_ids.shape[1] for x in parts)
    width_c = max(x.completion_ids.shape[1] for x in parts)

    def fit(t: Tensor, width: int, left: bool, fill) -> Tensor:
        pad = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype, device=t.device)
        return torch.cat([pad, t] if left else [t, pad], dim=1)

    def cat(key: str, width: int, left: bool, fill):
        return torch.cat([fit(getattr(x, key), width, left, fill) for x in parts])

    sampling = None
    if all(x.sampling_logprobs is not None for x in parts):
        sampling = torch.cat([fit(x.sampling_logprobs, width_c, False, 0.0) for x in parts])
    return RolloutBatch(cat("prompt_ids", width_p, True, pad_id), cat("prompt_mask", width_p, True, False),
                        cat("completion_ids", width_c, False, pad_id), cat("completion_mask", width_c, False, False),
                        cat("old_logprobs", width_c, False, 0.0), [r for x in parts for r in x.finish_reasons],
                        [t for x in parts for t in x.completion_texts], sampling)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token id lists.

    Returns:
        ``([N, P] int64 ids, [N, P] bool mask)``.
    """
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    width = int(lengths.max())
    mask = torch.arange(width).unsqueeze(0) >= (width - lengths).unsqueeze(1)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    ids[mask] = torch.tensor([t for s in sequences for t in s], dtype=torch.long)  # row-major: each row's tail
    return ids, mask


class RolloutEngine(Protocol):
    """A sampler of completions: the Hugging Face engine and the vLLM engine implement it.

    ``generate`` samples ``num_generations`` completions per prompt with the policy's
    settings only (temperature, top_p, top_k, length; nothing from the model's own
    generation config) and returns a :class:`RolloutBatch` with per-token log-probs of the
    tempered distribution. ``weights_version`` is the policy's count of optimizer steps
    (:attr:`~mrl_lightning.policy.PolicyModule.optimizer_steps_taken`): an engine that
    holds its own copy of the weights (vLLM) pushes new ones when it changed; one that
    runs the model itself ignores it. ``prompt_seeds`` (one per prompt) make each prompt's
    completions depend on its seed alone, not on the other prompts of the call, so
    placements that split the prompts differently sample the same completions; None =
    seeds drawn from torch's current generator. ``stop_token_ids`` end a completion (finish
    ``stop``, the stop token kept and counted), and so do ``stop`` strings, cut as vLLM cuts them
    (:mod:`mrl_lightning.rollout.stops`); every engine stops on the same set.
    """

    name: str

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
    ) -> RolloutBatch: ...
