"""Non-finite numbers from a model: named at sampling, skipped (and counted) at an update.

Sampling. ``torch.multinomial`` refuses probabilities holding NaN or inf with a message
that names neither the policy nor a cause; a model whose logits are NaN or +inf has
weights (or inputs) that are no longer finite. :func:`named_sampling_errors` turns that
error into a :class:`NonFiniteError` naming the policy and what to do, and
:func:`check_finite_logprobs` catches what sampling lets through (greedy decoding picks a
token from NaN logits without complaint; its log-prob is then NaN).

Updates. A loss or gradient that is NaN or inf once (a rare token, an overflow under
reduced precision) would write NaN into every weight at ``optimizer.step()``. As a mixed
precision gradient scaler does, such an update is skipped instead: no step, the gradient
dropped, ``train/<policy>/nonfinite_updates_skipped`` counts it and a warning names the
policy. :data:`MAX_CONSECUTIVE_SKIPS` skipped updates in a row stop the run with an error,
since a policy that cannot take a finite step is not training.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

MAX_CONSECUTIVE_SKIPS = 10
_SAMPLING_MESSAGES = ("probability tensor contains", "invalid multinomial distribution")


class NonFiniteError(RuntimeError):
    """A policy's model produced NaN or inf where a finite number is needed."""


def _advice(policy_name: str) -> str:
    return (f"The weights of policy {policy_name!r} (or its inputs) are no longer finite: an update blew up "
            "(learning_rate too high, max_grad_norm null) or the model folder holds NaN weights. Resume from the "
            "last good checkpoint (--ckpt_path) with a lower learning_rate and max_grad_norm set, and check the "
            "model's weights with torch.isfinite.")


@contextmanager
def named_sampling_errors(policy_name: str) -> Iterator[None]:
    """Re-raise torch's "probability tensor contains inf / nan" as :class:`NonFiniteError`.

    Raises:
        NonFiniteError: sampling met NaN / inf probabilities (the original error chained).
    """
    try:
        yield
    except RuntimeError as exc:
        if not any(m in str(exc) for m in _SAMPLING_MESSAGES):
            raise
        raise NonFiniteError(f"policy {policy_name!r}: sampling met NaN or inf logits ({str(exc).strip()}). "
                             + _advice(policy_name)) from exc


def check_finite_logprobs(policy_name: str, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise when a counted completion token has a NaN or +-inf sampling log-prob.

    Args:
        policy_name: Named in the error.
        logprobs: ``[N, L]`` float32 nats (the rollout's old log-probs).
        mask: ``[N, L]`` bool, True = counted.

    Raises:
        NonFiniteError: names the policy, how many tokens, and what to do.
    """
    bad = ~torch.isfinite(logprobs) & mask
    if bool(bad.any()):
        rows = int(bad.any(dim=1).sum())
        raise NonFiniteError(f"policy {policy_name!r}: {int(bad.sum())} sampled tokens in {rows} of "
                             f"{logprobs.shape[0]} completions have a non-finite log-prob (NaN or inf logits). "
                             + _advice(policy_name))


def gradient_norm(params) -> float:
    """Total 2-norm of the gradients of ``params`` (NaN or inf when any entry is); 0 without gradients."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: the whole mesh's


def skip_nonfinite_update(policy, params) -> bool:
    """True when an update's gradient holds NaN or inf: the caller drops it instead of stepping.

    Checked before clipping (clipping a NaN gradient only spreads it). Counts the skip on
    ``policy`` (``nonfinite_updates_skipped`` in all, and in a row) and warns (on the 1st,
    2nd, 4th, ... skip).

    Args:
        policy: The :class:`~mrl_lightning.policy.PolicyModule` being updated.
        params: Its trainable parameters, gradients accumulated (and reduced over ranks).

    Raises:
        NonFiniteError: the :data:`MAX_CONSECUTIVE_SKIPS`-th non-finite update in a row.
    """
    norm = gradient_norm(params)
    if norm == norm and norm != float("inf"):
        policy.nonfinite_streak = 0
        return False
    name = policy.policy_name
    policy.nonfinite_updates_skipped = getattr(policy, "nonfinite_updates_skipped", 0) + 1
    policy.nonfinite_streak = getattr(policy, "nonfinite_streak", 0) + 1
    if policy.nonfinite_streak >= MAX_CONSECUTIVE_SKIPS:
        raise NonFiniteError(f"policy {name!r}: {policy.nonfinite_streak} updates in a row had a non-finite gradient "
                             f"norm ({norm}); none was applied. " + _advice(name))
    total = policy.nonfinite_updates_skipped
    if total & (total - 1) == 0:
        warnings.warn(f"policy {name!r}: gradient norm {norm} (NaN or inf loss or gradient); this update is skipped "
                      f"(no optimizer step), {total} so far, counted in train/{name}/nonfinite_updates_skipped. "
                      f"{MAX_CONSECUTIVE_SKIPS} in a row stop the run.", stacklevel=2)
    return True
