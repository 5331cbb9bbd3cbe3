"""SuccessGatedTransfer callback: SGT on top of GRPO (``docs/probes.md``).

Thin adapter over :mod:`mrl_lightning.probes.sgt`: reads verified peer SuccessRecords
from SEE (``ctx.exchange``), retokenizes them with THL behind the receiver's own prompt
ids (as its own rollouts had them: BOS and template head kept, truncated alike) and ending
with the receiver's own end-of-turn token, and adds the transfer loss to the receiver's batch. Requires the ``"exchange"``
service (``SharedExperienceExchange`` earlier in the list; checked at set-up).

Logged under ``probe/sgt/<policy>/``: ``rescue_set_size`` (prompts), ``transfers``
(demos), ``nll_nats`` (mean per-token NLL of the transferred demos),
``rescued_later_solved_share`` (of the rescued prompts seen again in a later step, the
share the receiver then solved on-policy at least once; not logged until a rescued prompt
has been seen again, since it has no value before), ``retokenize_failures``. When SEE also
publishes RolloutRecords, each transferred success is mapped with its source tokens and
log-probs and the THL residual of the transferred batch is logged under
``thl/sgt/<policy>/``. On every step with a transfer the update logs the transfer's share
of the gradient it applied (``grad_share``, its window maximum ``grad_share_max``,
``grad_share_raw`` before the bound, ``grad_share_bound``; :mod:`mrl_lightning.objectives.aux_share`).

A prompt drawn twice in one step is rescued once per policy, also when its draws sit on
different ranks of the policy's group (the first eligible draw in batch order, as one rank
would choose).

State (checkpointed, and merged over worker processes by :meth:`merge_rank_states`): per
policy, the prompts rescued so far, those seen again after a rescue, and those of them
solved on-policy. A policy on several ranks gathers every rank's additions each step, so
each of its ranks holds the whole policy's bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch

from mrl_lightning.callbacks.base import MRLCallback, exchange_step, prepare_thl
from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import RolloutRecord, SuccessRecord
from mrl_lightning.probes.ledger import RescueLedger, merge_ledger_states
from mrl_lightning.probes.sgt import (ShareBound, eligible_rows, first_eligible_draws, rescue_set,
                                      transfer_group_advantages)
from mrl_lightning.callbacks.rescue_control import note_rescue_control
from mrl_lightning.callbacks.sgt_terms import _SGTGroupLoss, _SGTTransferLoss, pack_ids, unpack_ids
from mrl_lightning.metrics import Mean, Sum
from mrl_lightning.thl import residual_metrics, retokenize, transfer_trace


TRANSFER_MODES = ("nll", "group")


class SuccessGatedTransfer(MRLCallback):
    """Success-Gated Transfer probe.

    Args:
        lambda_sgt: Transfer weight lambda (``docs/probes.md``). In a prototype of the
            embedded default ~0.1 kept the strong part; 1.0 made a tiny GPT-2 forget it.
        lambda_per_policy: Optional per-receiver overrides of ``lambda_sgt`` by policy name.
        advantage_plus: A_plus given to a verified success.
        kappa: A prompt is rescued when the receiver's own success rate <= kappa.
        max_transfers_per_prompt: m, distinct verified peer successes per rescue prompt.
        max_staleness: Use peer successes at most this many rollout steps old (the
            bounded per-prompt memory); None = any still held by the exchange.
        receivers: Policies that receive transfers; None = all.
        max_grad_share: Bound b in (0, 1) on the transfer term's share of the update,
            ``||g_sgt|| / (||g_grpo|| + ||g_sgt||)`` (L2 norms of the two gradients before
            clipping); a larger share is scaled down to b for that step
            (:mod:`mrl_lightning.objectives.aux_share`). None = no bound. The share is logged
            either way as ``probe/sgt/<policy>/grad_share``.
        max_grad_share_final: A schedule: the bound moves linearly from ``max_grad_share`` at the
            run's first step to this ``max_grad_share_ramp_steps`` steps later; None = no schedule.
        max_grad_share_ramp_steps: Steps of that ramp.
        max_grad_share_low: A receiver-adaptive bound: ``max_grad_share`` while the receiver's
            strong part holds (its own strong-part rollout success, averaged, against its best over
            the first ``adaptive_reference_steps`` steps), falling to this as the strong part drops by
            ``adaptive_drop`` (relative); None = not adaptive
            (:class:`~mrl_lightning.probes.sgt.ShareBound`). The step's bound is logged as
            ``probe/sgt/<p>/grad_share_bound``.
        adaptive_drop: The relative strong-part drop at which the bound reaches ``max_grad_share_low``.
        adaptive_ema: Moving-average rate of the strong-part success the adaptive bound follows.
        adaptive_reference_steps: Steps over which the strong part's reference is taken.
        grad_share_floor: The least GRPO gradient norm (L2, the units of ``max_grad_norm``) the
            bound is measured against: the transfer is scaled to at most
            ``b / (1 - b) * max(||g_grpo||, floor)``. None (the default) = strict: the transfer's
            share of the applied update is at most the bound on every step, and a step on which
            every group's rewards tie (GRPO gradient 0, with ``beta`` 0) gets no transfer. A
            floor lets such steps (the regime rescue is for) still transfer, at the size of a
            typical GRPO step; their share of the applied update is then above the bound, and
            ``probe/sgt/<p>/grad_share_floor_active`` says so (docs/probes.md, "Bound").
        transfer_mode: ``"nll"``: the transfer term ``lambda * A_plus * mean NLL`` over the
            step's demos (:func:`~mrl_lightning.probes.sgt.sgt_loss`). ``"group"``: each demo
            joins its prompt's group as an extra sample with its combined reward (every reward
            function, as own samples are scored); the group's
            advantages are recomputed over own + demos and the demos are trained on like own
            samples of the batch, weighted by lambda
            (:func:`~mrl_lightning.probes.sgt.sgt_group_loss`; ``advantage_plus`` unused). Refused with
            ``max_grad_share`` (no part of the update is the transfer's alone there) and for a
            receiver with ``filter_groups``.

    Raises:
        ValueError: out-of-range values (all at once).
    """

    def __init__(
        self,
        lambda_sgt: float = 0.1,
        lambda_per_policy: dict[str, float] | None = None,
        advantage_plus: float = 1.0,
        kappa: float = 0.0,
        max_transfers_per_prompt: int = 1,
        max_staleness: int | None = None,
        receivers: list[str] | None = None,
        max_grad_share: float | None = None,
        transfer_mode: str = "nll",
        max_grad_share_final: float | None = None,
        max_grad_share_ramp_steps: int = 1000,
        max_grad_share_low: float | None = None,
        adaptive_drop: float = 0.1,
        adaptive_ema: float = 0.05,
        adaptive_reference_steps: int = 50,
        grad_share_floor: float | None = None,
    ) -> None:
        errors = []
        if lambda_sgt < 0:
            errors.append(f"SuccessGatedTransfer.lambda_sgt={lambda_sgt} must be >= 0 (the transfer term's weight).")
        negative = {k: v for k, v in (lambda_per_policy or {}).items() if v < 0}
        if negative:
            errors.append(f"SuccessGatedTransfer.lambda_per_policy {negative} must be >= 0 (each a transfer term's "
                          "weight).")
        if not 0.0 <= kappa <= 1.0:
            errors.append(f"SuccessGatedTransfer.kappa={kappa} must be in [0, 1].")
        if max_transfers_per_prompt < 1:
            errors.append(f"SuccessGatedTransfer.max_transfers_per_prompt={max_transfers_per_prompt} must be >= 1.")
        if max_staleness is not None and max_staleness < 0:
            errors.append(f"SuccessGatedTransfer.max_staleness={max_staleness} must be >= 0 or null.")
        bad_share = max_grad_share is not None and not 0.0 < max_grad_share < 1.0
        if bad_share:  # said here once; the bound below is then not built
            errors.append(f"SuccessGatedTransfer.max_grad_share={max_grad_share} must be in (0, 1) (a share of "
                          "the update, e.g. 0.5) or null for no bound.")
        if grad_share_floor is not None and not grad_share_floor >= 0:
            errors.append(f"SuccessGatedTransfer.grad_share_floor={grad_share_floor!r} must be >= 0 (a gradient norm, "
                          "e.g. the median of probe/sgt/<p>/grpo_grad_norm) or null for the strict bound.")
        if grad_share_floor is not None and max_grad_share is None:
            errors.append("SuccessGatedTransfer.grad_share_floor is set but max_grad_share is null: the floor is "
                          "what the bound is measured against; set max_grad_share, or grad_share_floor: null.")
        if transfer_mode not in TRANSFER_MODES:
            errors.append(f"SuccessGatedTransfer.transfer_mode={transfer_mode!r}; valid: {list(TRANSFER_MODES)}.")
        elif transfer_mode == "group" and max_grad_share is not None:
            errors.append("SuccessGatedTransfer.transfer_mode='group' with max_grad_share="
                          f"{max_grad_share}: in group mode the demos rewrite their group's own advantages and join "
                          "the loss normalizers, so part of the transfer's effect is inside the GRPO gradient the "
                          "bound is measured against and no share of the update is the transfer's alone "
                          "(docs/probes.md, \"Bound\"). Use transfer_mode: nll with a bound, or max_grad_share: null "
                          "in group mode.")
        try:
            self.bound = None if bad_share else ShareBound(
                max_grad_share, max_grad_share_final, max_grad_share_ramp_steps, max_grad_share_low, adaptive_drop,
                adaptive_ema, adaptive_reference_steps)
        except ValueError as exc:
            errors.append(f"SuccessGatedTransfer bound options: {exc} (max_grad_share_final / _ramp_steps, "
                          "max_grad_share_low, adaptive_*).")
        if errors:
            raise ConfigError("\n".join(errors))
        self.max_grad_share, self.transfer_mode = max_grad_share, transfer_mode
        self.lambda_sgt, self.lambda_per_policy = lambda_sgt, dict(lambda_per_policy or {})
        self.advantage_plus, self.kappa = advantage_plus, kappa
        self.max_transfers_per_prompt, self.max_staleness = max_transfers_per_prompt, max_staleness
        self.receivers = receivers
        self.grad_share_floor = grad_share_floor
        self._local: set[str] | None = None  # the receivers this rank updates (setup); None = all
        self.rescued: dict[str, set[str]] = {}
        self.seen_after_rescue: dict[str, set[str]] = {}
        self.solved_after_rescue: dict[str, set[str]] = {}
        self.ledger = RescueLedger()  # the control: weak-part re-draws, rescued or not (probes/ledger.py)
        self.bound_state: dict[str, dict[str, float | None]] = {}  # per receiver: strong-part level, reference

    @property
    def see_reads(self) -> dict[str, int | None]:
        """Record type read from SEE -> how many steps back (checked by SharedExperienceExchange)."""
        return {"success": self.max_staleness}

    requires = ("exchange",)

    def config_errors(self, ctx, system) -> list[str]:
        """Unknown policy names, ``transfer_mode: group`` beside a probe that replaces advantages, and
        ``transfer_mode: group`` for a receiver with ``filter_groups`` (dynamic sampling would drop the
        rescued all-fail groups whose advantages group mode rewrites).

        In group mode the rescued prompts' own advantages are those of the group own + demos,
        and the demos count in the loss normalizers; a probe with ``replaces_advantages``
        (XGRPO, PRP) for the same receivers would overwrite them (listed after SGT) or be
        overwritten (listed before), so the pair is refused; ``transfer_mode: nll`` only adds a
        loss term and composes with either, in any order.
        """
        names = list(system.policies)
        errors = [f"SuccessGatedTransfer names policy {name!r}, which is not in model.policies {names}."
                  for name in list(self.lambda_per_policy) + list(self.receivers or []) if name not in names]
        if self.transfer_mode == "group":
            mine = set(self.receivers if self.receivers is not None else names)
            errors.extend(f"SuccessGatedTransfer.transfer_mode='group' and policy {name!r} has filter_groups: true: "
                          "dynamic sampling drops a rescued all-fail group (it has no signal of its own) before the "
                          "update, so its demo would train alone with the group's advantage while its own samples "
                          "are gone and the demo stays in the normalizers. Use transfer_mode: nll with filter_groups."
                          for name in sorted(mine & set(names)) if getattr(system.policies[name], "filter_groups", False))
            for cb in getattr(ctx, "callbacks", []):
                theirs = getattr(cb, "receivers", None)
                if getattr(cb, "replaces_advantages", False) and mine & set(theirs if theirs is not None else names):
                    errors.append(f"SuccessGatedTransfer.transfer_mode='group' rewrites the rescued prompts' own "
                                  f"advantages (a group of own samples + demos) and {type(cb).__name__} replaces "
                                  "the own advantages too, for the same receivers: whichever is later in "
                                  "trainer.callbacks would win while the demos stay in the loss normalizers. Use "
                                  "transfer_mode: nll with it, or give the two probes different receivers.")
        return errors

    def on_compose_batch(self, ctx, system, policy, batch) -> None:
        name = policy.policy_name
        if self.receivers is not None and name not in self.receivers:
            return
        items = batch.scored.items
        own = batch.scored.success
        tag = f"probe/sgt/{name}"
        rescued, solved = self.rescued.setdefault(name, set()), self.solved_after_rescue.setdefault(name, set())
        seen = self.seen_after_rescue.setdefault(name, set())
        seen_now, solved_now = set(), set()
        for b, item in enumerate(items):  # before this step's rescues: "again" means a later step
            if item.prompt_id in rescued:
                seen_now.add(item.prompt_id)
                if bool(own[b].any()):
                    solved_now.add(item.prompt_id)
        prompt_ids = [x.prompt_id for x in items]
        records = ctx.exchange.query(SuccessRecord, receiver=name, step=exchange_step(ctx),
                                         prompt_ids=prompt_ids, max_staleness=self.max_staleness)
        peer: dict[str, list[str]] = {}
        source_of: dict[tuple[str, str], str] = {}
        reward_of: dict[tuple[str, str], float] = {}
        for rec in reversed(records):  # newest first
            peer.setdefault(rec.prompt_id, []).append(rec.completion_text)
            source_of.setdefault((rec.prompt_id, rec.completion_text), rec.source)
            reward_of.setdefault((rec.prompt_id, rec.completion_text), float(rec.reward))
        chosen = rescue_set(own, prompt_ids, peer, self.kappa, self.max_transfers_per_prompt,
                            rows=self._group_rows(ctx, name, own, prompt_ids, peer))
        traces_by_key = self._source_traces(ctx, chosen, items, source_of)
        demos, traces, failures = [], [], 0
        demo_rows: dict[int, list[float]] = {}  # row -> its demos' verifier rewards, in demo order
        demo_texts: dict[int, list[str]] = {}  # row -> its demos' texts, in demo order
        end = policy.end_of_turn_id if chosen else None  # a demo ends as the receiver's own completions do
        for b, texts in chosen.items():
            for text in texts:
                source = source_of[(items[b].prompt_id, text)]
                rollout = traces_by_key.get((items[b].prompt_id, source, text))
                if rollout is not None:  # the source's tokens are known: map the full trace (THL residual)
                    producer = system.policies[source]
                    trace = transfer_trace(producer.tokenizer, rollout.token_ids, rollout.logprobs,
                                           policy.tokenizer, batch.scored.prompt_texts[b], text, add_eos=True,
                                           eos_id=end, stop=producer.stop or (),
                                           include_stop_str_in_output=producer.include_stop_str_in_output)
                    traces.append(trace)
                    r = trace.retokenized
                else:
                    r = retokenize(policy.tokenizer, batch.scored.prompt_texts[b], text, add_eos=True, eos_id=end)
                if not r.round_trip_ok:
                    failures += 1
                    continue
                # behind the receiver's own prompt ids: rendered, encoded and truncated as its own rollouts were
                demos.append((batch.scored.own_prompt_ids(b), r.completion_ids))
                demo_rows.setdefault(b, []).append(reward_of[(items[b].prompt_id, text)])
                demo_texts.setdefault(b, []).append(text)
        if traces:
            batch.metrics.update(residual_metrics(traces, prefix=f"thl/sgt/{name}/"))
        weight = self.lambda_per_policy.get(name, self.lambda_sgt)
        # rescued: the rows a demo reached (one that retokenized, with a weight above 0), not every row chosen
        rescued_rows = set(demo_rows) if weight > 0 else set()
        bound = self._step_bound(ctx, policy, batch, tag)  # every step: the adaptive bound tracks the strong part
        if demos and weight > 0 and self.transfer_mode == "group":
            # A demo joins a group of own samples scored by the combined reward of every reward
            # function (reward_weights), not by the strict verifier's alone: score it the same way.
            rows = list(demo_rows)
            texts = [t for b in rows for t in demo_texts[b]]
            _, combined, _ = system.score(texts, [items[b] for b in rows for _ in demo_texts[b]])
            it = iter(combined.tolist())
            demo_rows = {b: [next(it) for _ in demo_texts[b]] for b in rows}
            self._join_groups(policy, batch, demos, demo_rows, weight, tag, bound)
        elif demos and weight > 0:
            batch.aux_losses.append(_SGTTransferLoss(demos, weight, self.advantage_plus, tag, bound,
                                                     policy.tokenizer.pad_token_id, self.grad_share_floor))
        batch.counts["sgt_demos"] = float(len(demos) if weight > 0 else 0)
        batch.metrics.update({
            f"{tag}/rescue_set_size": Sum(len(rescued_rows)), f"{tag}/transfers": Sum(batch.counts["sgt_demos"]),
            f"{tag}/retokenize_failures": Sum(failures),
        })
        self._note(ctx, name, seen_now, solved_now, {items[b].prompt_id for b in rescued_rows})
        note_rescue_control(ctx, self.ledger, policy, batch, rescued_rows, tag, "rescued")
        if seen:
            batch.metrics[f"{tag}/rescued_later_solved_share"] = Mean(len(solved & seen) / len(seen), len(seen))

    def _step_bound(self, ctx, policy, batch, tag: str) -> float | None:
        """This step's ``max_grad_share`` for ``policy`` (:class:`ShareBound`), logged as ``<tag>/grad_share_bound``.

        The adaptive bound follows the receiver's own strong-part rollouts of the step, summed over its ranks.
        """
        name = policy.policy_name
        state = self.bound_state.setdefault(name, {"level": None, "reference": None})
        index = getattr(ctx, "global_step", ctx.rollout_step - 1)  # updates before this one; bounds count from 0
        if self.bound.low is not None:
            strong = getattr(policy, "strong_parts", None) or []
            rows = [b for b, item in enumerate(batch.scored.items) if item.part in strong]
            counts = {"successes": float(batch.scored.success[rows].sum()) if rows else 0.0,
                      "count": float(batch.scored.success[rows].numel()) if rows else 0.0}
            workers = getattr(ctx, "workers", None)
            if workers is not None and workers.group_size(name) > 1:
                counts = workers.group_sum(name, counts)
            self.bound.track(state, index, counts["successes"], counts["count"])
        value = self.bound.step_bound(index, state["level"], state["reference"])
        if value is not None:
            batch.metrics[f"{tag}/grad_share_bound"] = value
        return value

    def setup(self, ctx, system, datamodule) -> None:
        """Note the receivers this rank updates (its checkpoint state holds their bound state only) and build
        THL's tables now, not in the first step that transfers (:func:`~mrl_lightning.callbacks.base.prepare_thl`)."""
        workers = getattr(ctx, "workers", None)
        self._local = set(workers.local_policies) if workers is not None else None
        prepare_thl(ctx, system, self.receivers)

    def _group_rows(self, ctx, name: str, own, prompt_ids: list[str], peer) -> set[int] | None:
        """On a group of several ranks, the rows of this rank's shard that may be rescued: a prompt drawn
        twice in the step is rescued once per group, at its first eligible draw in batch order
        (:func:`~mrl_lightning.probes.sgt.first_eligible_draws`); None on one rank (``rescue_set``
        de-duplicates alone)."""
        workers = getattr(ctx, "workers", None)
        if workers is None or workers.group_size(name) == 1:
            return None
        mine = list(zip(prompt_ids, eligible_rows(own, prompt_ids, peer, self.kappa)))
        return first_eligible_draws(workers.group_gather(name, mine))[workers.group_index(name)]

    def _note(self, ctx, name: str, seen: set[str], solved: set[str], rescued: set[str]) -> None:
        """Add this step's prompts seen again, solved again and rescued to ``name``'s bookkeeping.

        On a group of several ranks each rank sees its shard only: the step's additions of every
        rank are gathered, so each rank holds the bookkeeping one rank on the whole batch would
        (the same on every rank; a resumed run restores it exactly).
        """
        workers = getattr(ctx, "workers", None)
        if workers is not None and workers.group_size(name) > 1:
            parts = workers.group_gather(name, (sorted(seen), sorted(solved), sorted(rescued)))
            seen, solved, rescued = ({pid for part in parts for pid in part[k]} for k in range(3))
        self.seen_after_rescue[name] |= seen
        self.solved_after_rescue[name] |= solved
        self.rescued[name] |= rescued

    def _join_groups(self, policy, batch, demos, demo_rows: dict[int, list[float]], weight: float, tag: str,
                     bound: float | None) -> None:
        """``transfer_mode: group``: the demos join their prompts' groups as extra samples.

        The rescued rows' own advantages are replaced by those over the group of own + demos
        (:func:`~mrl_lightning.probes.sgt.transfer_group_advantages`), and the demos' tokens and
        sequences are added to the batch's loss normalizers (so the GRPO term and the transfer
        term share one denominator, as samples of one batch do).
        """
        rows = list(demo_rows)
        own, demo_adv = transfer_group_advantages(batch.scored.rewards[rows], [demo_rows[b] for b in rows],
                                                  policy.scale_rewards)
        advantages = batch.advantages.clone()
        advantages[rows] = own.to(advantages.dtype)
        batch.advantages = advantages
        batch.counts["sequences"] = batch.counts.get("sequences", 0.0) + float(len(demos))
        batch.counts["tokens"] = batch.counts.get("tokens", 0.0) + float(sum(len(c) for _, c in demos))
        flat = torch.cat(demo_adv)
        batch.aux_losses.append(_SGTGroupLoss(demos, flat, weight, tag, bound, policy.tokenizer.pad_token_id,
                                              self.grad_share_floor))
        batch.metrics[f"{tag}/transfer_advantage_mean"] = Mean(float(flat.mean()), len(flat))

    @staticmethod
    def _source_traces(ctx, chosen, items, source_of) -> dict[tuple[str, str, str], RolloutRecord]:
        """The source's RolloutRecord of each chosen success, when SEE published rollouts."""
        wanted = {items[b].prompt_id for b in chosen}
        if not wanted:
            return {}
        out = {}
        for rec in ctx.exchange.query(RolloutRecord, prompt_ids=sorted(wanted)):
            if source_of.get((rec.prompt_id, rec.completion_text)) == rec.source:
                out.setdefault((rec.prompt_id, rec.source, rec.completion_text), rec)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Per policy, the prompt ids of ``rescued``, ``seen_after_rescue``, ``solved_after_rescue``,
        each set packed by :func:`pack_ids` (these sets grow to every prompt of a task: packed,
        ~3.4 bytes an id in a checkpoint instead of ~18); the control's ledger; and the bound's
        state of the receivers this rank updates (the adaptive bound's level and reference)."""
        return {"rescued": {k: pack_ids(v) for k, v in self.rescued.items()},
                "seen_after_rescue": {k: pack_ids(v) for k, v in self.seen_after_rescue.items()},
                "solved_after_rescue": {k: pack_ids(v) for k, v in self.solved_after_rescue.items()},
                "ledger": self.ledger.state_dict(),
                "bound": {k: dict(v) for k, v in self.bound_state.items() if self._local is None or k in self._local}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s sets. A state without ``seen_after_rescue`` (written
        before it was kept) takes the solved prompts as the ones seen again: they were."""
        self.rescued = {k: unpack_ids(v) for k, v in state_dict["rescued"].items()}
        self.solved_after_rescue = {k: unpack_ids(v) for k, v in state_dict["solved_after_rescue"].items()}
        seen = state_dict.get("seen_after_rescue", state_dict["solved_after_rescue"])
        self.seen_after_rescue = {k: unpack_ids(v) for k, v in seen.items()}
        self.ledger = RescueLedger()
        if "ledger" in state_dict:  # written before the control was kept: it starts empty
            self.ledger.load_state_dict(state_dict["ledger"])
        # "scale" / "measured_at" of a checkpoint written with the removed measure_share_every_n_steps are dropped
        self.bound_state = {k: {key: v[key] for key in ("level", "reference") if key in v}
                            for k, v in state_dict.get("bound", {}).items()}

    def merge_rank_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state from this callback's :meth:`state_dict` on several worker processes.

        Each worker sees only some policies, or some prompts of one policy, so per policy
        the merged ``rescued``, ``seen_after_rescue`` and ``solved_after_rescue`` are the
        unions of the workers' sets. The bound's state (``bound``) is per receiver and taken from
        the workers that update that receiver (they hold equal copies; :meth:`state_dict` writes
        only the receivers its rank updates). Pure: neither ``states`` nor ``self`` is changed.

        Args:
            states: ``state_dict()`` of every worker (older states without
                ``seen_after_rescue`` are read as :meth:`load_state_dict` reads them).

        Returns:
            A state in :meth:`state_dict`'s format (packed sets), for :meth:`load_state_dict`.

        Raises:
            ValueError: ``states`` is empty, or one of them lacks ``rescued`` /
                ``solved_after_rescue`` (names its index).
        """
        if not states:
            raise ValueError("SuccessGatedTransfer.merge_rank_states: states=[] is empty; pass the state_dict() "
                             "of at least one worker.")
        merged: dict[str, dict[str, set[str]]] = {
            "rescued": {}, "seen_after_rescue": {}, "solved_after_rescue": {}}
        for i, state in enumerate(states):
            missing = [k for k in ("rescued", "solved_after_rescue") if k not in state]
            if missing:
                raise ValueError(f"SuccessGatedTransfer.merge_rank_states: states[{i}] has no {missing}; pass "
                                 "SuccessGatedTransfer.state_dict() results.")
            parts = {"rescued": state["rescued"], "solved_after_rescue": state["solved_after_rescue"],
                     "seen_after_rescue": state.get("seen_after_rescue", state["solved_after_rescue"])}
            for key, per_policy in parts.items():
                for policy, prompts in per_policy.items():
                    merged[key].setdefault(policy, set()).update(unpack_ids(prompts))
        out = {key: {policy: pack_ids(prompts) for policy, prompts in per_policy.items()}
               for key, per_policy in merged.items()}
        out["ledger"] = merge_ledger_states([state["ledger"] for state in states if "ledger" in state])
        # per receiver, from the ranks that update it (each rank's state holds only its own receivers, so a
        # copy another rank loaded at a resume and never updated cannot overwrite the live one)
        out["bound"] = {k: v for state in states for k, v in state.get("bound", {}).items()}
        return out
