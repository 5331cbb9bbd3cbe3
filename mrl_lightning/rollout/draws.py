"""How the HF engine draws tokens from each prompt's seed, and reads their log-probs, as logits processors.

``generate`` runs a greedy search over scores that :func:`seeded_sampling`'s processors
prepare (docs/rollout.md, "Seeds"): tempered, filtered (top-k, top-p), and then made to peak
at a token drawn from ``softmax`` of the filtered scores with the row's prompt's own
generator. Two draws (``sampling_draw``), one distribution:

- ``race`` (the default's): ``-log E`` with ``E ~ Exp(1)`` added per row and vocabulary
  entry; the argmax is the draw (the exponential race, equivalent to the Gumbel-max trick).
  A prompt's generator draws ``[G, V]`` exponentials per step: at V = 262,144 that is about
  100 ms a step on one core of this CPU (``exponential_`` is not vectorized), more than the
  forward of a 270M model.
- ``inverse_cdf``: one ``U(0, 1]`` per row and step against the cumulative softmax (in
  float64), the scores then 0 at the drawn token and ``-inf`` elsewhere. A prompt's
  generator draws ``[G]`` numbers per step: about 10x cheaper at V = 262,144
  (benchmarks/hf_sampling.py, docs/speed.md). Other tokens than ``race`` for the same seed.

Either way a prompt's completions depend only on its seed, the weights and the settings,
whatever else the batch holds. :class:`SampledLogprobs`, placed right after the temperature,
keeps each sampled token's log-prob under the tempered, unfiltered distribution, holding one
step's ``[N, V]`` scores at a time instead of ``generate``'s every-step logits
(``output_logits``: ``[N, L, V]`` float32, 537 MB for N = 16, L = 32, V = 262,144).
"""

from __future__ import annotations

import torch
from torch import Tensor

SAMPLING_DRAWS = ("race", "inverse_cdf")


def seeded_sampling(prompt_seeds: list[int] | None, num_prompts: int, num_generations: int, temperature: float,
                    top_p: float, top_k: int, draw: str = "race", record: "SampledLogprobs | None" = None):
    """Logits processors that sample each prompt's completions from its own seed (module docstring).

    Args:
        prompt_seeds: One seed per prompt, or None to draw them from torch's current generator.
        num_prompts: B.
        num_generations: G rows per prompt (prompt-major).
        temperature: > 0.
        top_p: Nucleus threshold in (0, 1]; 1 = off.
        top_k: Top-k, 0 = off.
        draw: ``race`` or ``inverse_cdf``.
        record: A :class:`SampledLogprobs` (with ``temperature=None``) to place after the temperature.

    Returns:
        A ``transformers.LogitsProcessorList`` for ``generate`` with greedy search.

    Raises:
        ValueError: ``prompt_seeds`` does not hold one seed per prompt, or an unknown ``draw``.
    """
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if draw not in SAMPLING_DRAWS:
        raise ValueError(f"sampling_draw={draw!r}; valid: {', '.join(SAMPLING_DRAWS)}.")
    if prompt_seeds is None:
        prompt_seeds = torch.randint(0, 2**62, (num_prompts,)).tolist()
    if len(prompt_seeds) != num_prompts:
        raise ValueError(f"prompt_seeds has {len(prompt_seeds)} seeds for {num_prompts} prompts; give one per prompt.")
    processors = [TemperatureLogitsWarper(temperature)]
    if record is not None:
        processors.append(record)
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    kind = _PerPromptRace if draw == "race" else _PerPromptInverseCDF
    processors.append(kind(list(prompt_seeds), num_generations))
    return LogitsProcessorList(processors)


class _PerPrompt:
    """One generator per prompt, seeded at the first step on the scores' device."""

    def __init__(self, seeds: list[int], num_generations: int) -> None:
        self.seeds, self.g = seeds, num_generations
        self.generators: list[torch.Generator] | None = None

    def _generators(self, device) -> list[torch.Generator]:
        if self.generators is None:
            self.generators = [torch.Generator(device=device).manual_seed(int(s)) for s in self.seeds]
        return self.generators


class _PerPromptRace(_PerPrompt):
    """Adds ``-log E`` (``E ~ Exp(1)``) to the scores, one generator per prompt (module docstring)."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        vocab = scores.shape[1]
        race = torch.cat([torch.empty((self.g, vocab), device=scores.device, dtype=torch.float32)
                          .exponential_(generator=gen) for gen in self._generators(scores.device)])
        return scores - race.log()


class _PerPromptInverseCDF(_PerPrompt):
    """Draws each row's token by inverse CDF from one ``U(0, 1]`` of its prompt's generator (module docstring)."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        u = torch.cat([1.0 - torch.rand((self.g,), generator=gen, device=scores.device, dtype=torch.float64)
                       for gen in self._generators(scores.device)])  # (0, 1]
        cdf = torch.softmax(scores.float(), dim=-1).double().cumsum(dim=-1)
        # the first token whose cumulative mass reaches u * total: cdf[i - 1] < target <= cdf[i], so p_i > 0
        token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).clamp(max=scores.shape[1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


class SampledLogprobs:
    """A logits processor that keeps each step's sampled-token log-prob, one step's scores at a time.

    At each call it stores the scores it sees (tempered by ``temperature`` first when given;
    placed right after the temperature warper it gets them tempered already: ``None``) and
    their logsumexp; at the next call it reads the token the previous step appended
    (``input_ids[:, -1]``) and keeps ``scores[token] - logsumexp``, the same floats the
    tempered log-softmax of that step's logits gives (docs/rollout.md). It returns the scores
    unchanged.

    Args:
        temperature: Divide the scores by it first (greedy search, where no warper tempers);
            None = the scores are tempered already.
    """

    def __init__(self, temperature: float | None = None) -> None:
        self.temperature = temperature
        self.steps: list[Tensor] = []
        self._last: tuple[Tensor, Tensor] | None = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self._last is not None:
            self._take(input_ids[:, -1])
        scaled = scores if self.temperature is None else scores / self.temperature
        self._last = (scaled, torch.logsumexp(scaled, dim=-1))
        return scores

    def _take(self, tokens: Tensor) -> None:
        scaled, logz = self._last
        self.steps.append(scaled.gather(1, tokens.unsqueeze(1)).squeeze(1) - logz)
        self._last = None

    def logprobs(self, completion: Tensor) -> Tensor:
        """``[N, L]`` float32 nats of ``completion`` (``[N, L]`` int64, the tokens ``generate`` appended)."""
        if self._last is not None:
            self._take(completion[:, len(self.steps)])
        return torch.stack(self.steps, dim=1)
