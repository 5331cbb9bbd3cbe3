"""SharedExperienceExchange callback: publishes each step's SEE records (docs/see.md, docs/loop.md).

Thin adapter: the records and the buffer live in :mod:`mrl_lightning.exchange`. It
publishes, for every policy and prompt, one GroupStatsRecord, one RolloutRecord per
completion, and one SuccessRecord per completion the strict verifier accepted (never a
self-reported success). It provides the ``"exchange"`` service (``ctx.exchange``) that
probes require, and saves the exchange in checkpoints, so a resumed run has the same
exchange contents.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mrl_lightning.callbacks.base import MRLCallback, exchange_step
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import (
    ExperienceExchange,
    GroupStatsRecord,
    RolloutRecord,
    SuccessRecord,
)
from mrl_lightning.thl import token_bytes, tokenizer_fingerprint
from mrl_lightning.writable import write_problem

RECORD_NAMES = ("rollout", "group_stats", "success")


def _char_offsets(pieces: list[bytes], text: str) -> tuple[tuple[int, int], ...]:
    """Character offsets of byte pieces in ``text`` (pieces inside one character share its span)."""
    byte_to_char = []
    for ci, ch in enumerate(text):
        byte_to_char.extend([ci] * len(ch.encode("utf-8", errors="surrogatepass")))
    out, pos = [], 0
    for piece in pieces:
        if not piece or pos >= len(byte_to_char):
            out.append((len(text), len(text)) if piece else (0, 0))
            pos += len(piece)
            continue
        start = byte_to_char[pos]
        end_byte = min(pos + len(piece), len(byte_to_char)) - 1
        out.append((start, byte_to_char[end_byte] + 1))
        pos += len(piece)
    return tuple(out)


class SharedExperienceExchange(MRLCallback):
    """Publishes typed records into an :class:`ExperienceExchange` every step.

    Args:
        capacity: Records held at most (oldest evicted first).
        max_staleness: Records older than this many rollout steps are evicted; None = keep.
        record_types: Which records to publish: any of "rollout", "group_stats", "success".
        log_path: Append-only JSONL audit log; relative paths are inside the run folder (a
            resumed run writes a new one in its own folder); an absolute path is one file
            for the run and its resumes (cut back to the checkpoint on resume).
        max_bytes: Estimated bytes held at most (oldest evicted first; see
            :func:`~mrl_lightning.exchange.records.record_nbytes`); None = no byte bound.
            The held records are saved in every checkpoint, so this also bounds the
            exchange's share of a checkpoint (about a seventh of the estimate: a record
            pickles to 80-200 bytes).
        max_staleness_by_type: Staleness windows for some record types, replacing
            ``max_staleness`` for them, e.g. ``{rollout: 0}``: rollouts of the current
            step only, which is all SGT's THL residual metric reads.
        rollouts_of_successes_only: Publish a RolloutRecord only for completions the
            strict verifier accepted (SGT's THL residual metric reads no other); False =
            every completion (PRP pools failures too). Fewer records to send between
            workers and to hold.

    Raises:
        ValueError: unknown record type names, or invalid bounds (all at once).
    """

    def __init__(
        self,
        capacity: int = 100_000,
        max_staleness: int | None = None,
        record_types: list[str] | None = None,
        log_path: str | None = None,
        max_bytes: int | None = None,
        max_staleness_by_type: dict[str, int] | None = None,
        rollouts_of_successes_only: bool = False,
    ) -> None:
        record_types = list(record_types or RECORD_NAMES)
        self.rollouts_of_successes_only = rollouts_of_successes_only
        bad = [r for r in record_types if r not in RECORD_NAMES]
        if bad:
            raise ValueError(f"SharedExperienceExchange.record_types has unknown {bad}; valid: {list(RECORD_NAMES)}.")
        self.capacity, self.max_staleness, self.record_types = capacity, max_staleness, record_types
        self.max_bytes, self.max_staleness_by_type = max_bytes, dict(max_staleness_by_type or {})
        self.log_path = log_path
        try:
            self.exchange = self._new_exchange()
        except ValueError as exc:
            raise ConfigError(f"Invalid SharedExperienceExchange config: {exc}.") from None

    def _new_exchange(self, log_path: str | None = None) -> ExperienceExchange:
        return ExperienceExchange(capacity=self.capacity, max_staleness=self.max_staleness, log_path=log_path,
                                  max_bytes=self.max_bytes, max_staleness_by_type=self.max_staleness_by_type)

    provides = ("exchange",)

    def services(self) -> dict[str, Any]:
        """``{"exchange": ExperienceExchange}``: the buffer probes read (``ctx.exchange``)."""
        return {"exchange": self.exchange}

    def config_errors(self, ctx, system) -> list[str]:
        """Probes (callbacks with ``see_reads``) that need records this exchange does not publish or keep."""
        errors = []
        if self.log_path and os.path.isabs(self.log_path):  # a relative one is in the run folder, checked as it
            problem = (f"{self.log_path!r} is a folder" if os.path.isdir(self.log_path)
                       else write_problem(os.path.dirname(self.log_path)))
            if problem is not None:
                errors.append(f"SharedExperienceExchange.log_path={self.log_path!r} cannot be written ({problem}); the "
                              "exchange's audit log is appended there from step 1. Give a file in a folder you can "
                              "write, a path relative to the run folder (log_path: exchange.jsonl), or log_path: null.")
        if self.rollouts_of_successes_only:
            errors += [f"{type(cb).__name__} reads every peer rollout (failures too), but SharedExperienceExchange."
                       "rollouts_of_successes_only=true publishes only successful ones; set it to false."
                       for cb in ctx.callbacks if getattr(cb, "reads_failed_rollouts", False)]
        for cb in ctx.callbacks:
            for name, steps in (getattr(cb, "see_reads", None) or {}).items():
                probe = type(cb).__name__
                if name not in self.record_types:
                    errors.append(f"{probe} reads {name!r} records, but SharedExperienceExchange.record_types="
                                  f"{self.record_types} leaves them out; add {name!r} to record_types.")
                    continue
                kept = self.max_staleness_by_type.get(name, self.max_staleness)
                if steps is not None and kept is not None and steps > kept:
                    by_type = name in self.max_staleness_by_type
                    where = f"max_staleness_by_type[{name!r}]" if by_type else "max_staleness"
                    errors.append(f"{probe}.max_staleness={steps} reads {name!r} records up to {steps} steps old, but "
                                  f"SharedExperienceExchange.{where}={kept} evicts them after {kept}; raise it to "
                                  f"{steps} or lower {probe}.max_staleness to {kept}.")
        return errors

    def setup(self, ctx, system, datamodule) -> None:
        if self.log_path and ctx.is_global_zero:  # every rank holds the same records; one writes the log
            path = self.log_path if os.path.isabs(self.log_path) else os.path.join(ctx.log_dir, self.log_path)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.exchange = self._new_exchange(log_path=path)

    def records_for(self, scored, step: int, policy, verifier) -> list:
        """SEE records of one policy's scored rollouts, flat (:meth:`records_by_prompt`, concatenated)."""
        return [rec for per_prompt in self.records_by_prompt(scored, step, policy, verifier) for rec in per_prompt]

    def records_by_prompt(self, scored, step: int, policy, verifier) -> list[list]:
        """SEE records of one policy's scored rollouts, one list per prompt in ``scored.items`` order."""
        out: list[list] = []
        r = scored.rollouts
        g = scored.num_generations
        fingerprint = tokenizer_fingerprint(policy.tokenizer)
        # Python lists once, not tensor indexing per row: this runs every step on every rank.
        ids_all, logp_all, mask_all = r.completion_ids.tolist(), r.old_logprobs.tolist(), r.completion_mask.tolist()
        rewards_all, success_all = scored.rewards.tolist(), scored.success.tolist()
        verifier_all = scored.verifier_rewards.tolist()
        for b, item in enumerate(scored.items):
            mine: list = []
            out.append(mine)
            if "group_stats" in self.record_types:
                rewards = scored.rewards[b]
                valid = rewards[~torch.isnan(rewards)]
                mine.append(GroupStatsRecord(
                    prompt_id=item.prompt_id, source=scored.policy, step=step, n=int(valid.numel()),
                    reward_mean=float(valid.mean()) if valid.numel() else float("nan"),
                    reward_std=float(valid.std()) if valid.numel() > 1 else 0.0,
                    success_count=int(scored.success[b].sum()),
                ))
            for k in range(g):
                row = b * g + k
                text = r.completion_texts[row]
                if "rollout" in self.record_types and (success_all[b][k] or not self.rollouts_of_successes_only):
                    counted = mask_all[row]
                    ids = [t for t, m in zip(ids_all[row], counted) if m]
                    mine.append(RolloutRecord(
                        prompt_id=item.prompt_id, source=scored.policy, step=step, completion_text=text,
                        token_ids=tuple(ids), logprobs=tuple(x for x, m in zip(logp_all[row], counted) if m),
                        offsets=_char_offsets(token_bytes(policy.tokenizer, ids), text),
                        reward=rewards_all[b][k], finish_reason=r.finish_reasons[row],
                        tokenizer_fingerprint=fingerprint, sample_index=k,
                    ))
                if "success" in self.record_types and success_all[b][k]:
                    mine.append(SuccessRecord(
                        prompt_id=item.prompt_id, source=scored.policy, step=step, completion_text=text,
                        reward=verifier_all[row],
                        verifier=verifier.name, verifier_version=verifier.version,
                    ))
        return out

    def on_rollouts_end(self, ctx, system, scored: dict) -> None:
        """Publish this step's records of every rank, in the same order on every rank (with
        ``trainer.max_lag`` L > 0: those of the batch the step trains, sampled L steps before, and
        staleness counts from it, ``ctx.exchange_step``; docs/mwra.md, "Pace"). Under ``mrl replay`` the logged
        policies' records of the batch sampled come from the run's log (docs/see.md, "Replay")."""
        step = ctx.rollout_step
        local = {name: self.records_by_prompt(s, step, system.policies[name], system.verifier)
                 for name, s in scored.items()}
        if scored and getattr(ctx, "replay", None) is not None:  # mrl replay: the logged policies' batch `step`
            ctx.replay.check(step, local)  # the replayed policies' own as the run logged them
            local.update(ctx.replay.records(step))
        workers = getattr(ctx, "workers", None)
        records = workers.exchange(local) if workers is not None else [
            r for per_policy in local.values() for per_prompt in per_policy for r in per_prompt]
        self.exchange.advance(exchange_step(ctx))  # stale records leave first, so the byte bound evicts only live ones
        self.exchange.publish(records)

    def on_train_step_end(self, ctx, system, metrics: dict) -> None:
        metrics.update(self.exchange.metrics())

    def state_dict(self) -> dict[str, Any]:
        return {"exchange": self.exchange.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.exchange.load_state_dict(state_dict["exchange"])

