"""The hook bus: callbacks the multi-module loop calls by name, and what each hook is handed (docs/loop.md).

The loop calls ``fabric.call(hook, ctx, ...)`` and every callback that defines the hook
answers, in list order. ``ctx`` is the run's :class:`HookContext`: everything a callback
may read about the run (counters, this rank's workers, services other callbacks provide,
the console); callbacks never read or write the trainer. Hooks, in the order one step
calls them:

``setup(ctx, system, datamodule)``
    once, after the policies are built, before step 1 (and before a checkpoint loads).
``on_fit_start(ctx, system)``
``on_rollouts_end(ctx, system, scored)``
    the exchange point: ``scored`` maps policy name -> :class:`ScoredRollouts` for the
    policies *this rank* runs (its share of the step's prompts); SEE sends its records to
    every rank here (``ctx.workers.exchange``).
``on_compose_batch(ctx, system, policy, batch)``
    once per policy this rank runs: probes add to :class:`TrainBatch` (advantages,
    auxiliary losses, loss normalizers in ``batch.counts``, metrics). Probes run in
    callback-list order. ``system.policies`` holds every policy's tokenizer on every
    rank, but only this rank's policies have a model.
``on_train_step_end(ctx, system, metrics)``
    after the update of every policy this rank runs; ``metrics`` holds this rank's
    scalars of the step; add scalars to it to log them (they are combined over ranks at
    each log step by their kind, :mod:`mrl_lightning.metrics`).
``on_eval_end(ctx, system, metrics)``
``on_fit_end(ctx, system)``

Before any model is built the loop calls ``config_errors(ctx, system)`` on every
callback (``ctx.workers`` is None then; ``ctx.placement`` is set) and checks what the
callbacks declare: each service a callback :attr:`~MRLCallback.requires` (e.g.
``"exchange"``) must be in the :attr:`~MRLCallback.provides` of a callback earlier in the
list (:func:`service_errors`). At ``setup`` the loop collects the providers' services
(:meth:`~MRLCallback.services`) into ``ctx.services``.

Callbacks with state implement ``state_dict`` / ``load_state_dict``; their
``state_key`` keeps two instances of one class apart in a checkpoint.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mrl_lightning.thl import prepare

# A service a callback can provide -> the callback users list for it (named in errors).
SERVICE_PROVIDERS = {"exchange": "mrl_lightning.callbacks.SharedExperienceExchange"}


class InContext:
    """A trainer counter that lives in its hooks' context (``trainer.ctx``), so hooks read it there."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.ctx, self.name)

    def __set__(self, trainer, value: int) -> None:
        setattr(trainer.ctx, self.name, value)


def exchange_step(ctx) -> int:
    """The step probes query the exchange at: ``ctx.exchange_step`` (the batch trained), or ``ctx.rollout_step``
    for a context without one (docs/mwra.md, "Pace")."""
    return getattr(ctx, "exchange_step", ctx.rollout_step)


@dataclass
class HookContext:
    """What every hook is handed about the run; the loop keeps it current.

    Attributes:
        callbacks: The callbacks, in list order.
        placement: The MWRA placement (ranks per policy; :class:`~mrl_lightning.mwra.Placement`).
        workers: This rank's :class:`~mrl_lightning.mwra.Workers` (its policies, shards,
            collectives); None before the processes are launched (``config_errors``).
        fabric: The Fabric instance (``autocast`` for forward passes in the update's precision).
        log_dir: The run folder.
        is_global_zero: True on rank 0.
        print: Prints once (rank 0) to the console.
        global_step: Training steps done.
        rollout_step: Rollout phases done (the step a record of this step carries).
        max_lag: ``trainer.max_lag``: a step trains the batch sampled this many steps before (docs/mwra.md, "Pace").
        trained_batch: With a lag, the batch this step trains (None in lockstep: the one it sampled).
        services: Services provided by callbacks, by name (``"exchange"``: the SEE buffer).
        replay: Under ``mrl replay``, the :class:`~mrl_lightning.loop.replay.ReplayLog` of the policies whose
            records come from the run's exchange log (docs/see.md, "Replay"); None otherwise.
    """

    callbacks: list = field(default_factory=list)
    placement: Any = None
    workers: Any = None
    fabric: Any = None
    log_dir: str = ""
    is_global_zero: bool = True
    print: Callable[..., None] = print
    global_step: int = 0
    rollout_step: int = 0
    max_lag: int = 0
    trained_batch: int | None = None
    services: dict[str, Any] = field(default_factory=dict)
    replay: Any = None

    @property
    def exchange_step(self) -> int:
        """The batch this step trains, whose records are the exchange's newest: probes query with it and
        their staleness windows count from it; ``rollout_step`` in lockstep (docs/mwra.md, "Pace")."""
        return self.rollout_step if self.trained_batch is None else self.trained_batch

    @property
    def exchange(self):
        """The SEE buffer (:class:`~mrl_lightning.exchange.ExperienceExchange`), provided by
        :class:`~mrl_lightning.callbacks.SharedExperienceExchange`.

        Raises:
            LookupError: no callback provides it (checked at set-up; see :func:`service_errors`).
        """
        if "exchange" not in self.services:
            raise LookupError("no callback provides 'exchange': list mrl_lightning.callbacks.SharedExperienceExchange "
                              "before the probes in trainer.callbacks.")
        return self.services["exchange"]


class MRLCallback:
    """Base class of mrl-lightning callbacks (all hooks optional).

    Attributes:
        requires: Services this callback reads from ``ctx.services`` (e.g. ``("exchange",)``);
            a callback earlier in the list must provide each.
        provides: Services this callback provides (returned by :meth:`services` at set-up).
        replaces_advantages: The callback replaces the own samples' advantages when it composes
            a batch (XGRPO, PRP): with two such probes the later one's advantages are used.
        reads_failed_rollouts: The callback reads RolloutRecords of failed completions too (PRP),
            so SEE must publish every rollout, not the successes' only.
        is_control: The callback is the arm without sharing (``NoSharing``): refused beside a
            probe that shares (:func:`sharing_errors`).
    """

    requires: tuple[str, ...] = ()
    is_control: bool = False
    provides: tuple[str, ...] = ()
    replaces_advantages: bool = False
    reads_failed_rollouts: bool = False

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (class name by default)."""
        return type(self).__name__

    def config_errors(self, ctx: HookContext, system) -> list[str]:
        """Problems with this callback in this run, checked before any model is built."""
        return []

    def services(self) -> dict[str, Any]:
        """The services named in :attr:`provides`, by name (called once, at set-up)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def merge_rank_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state from this callback's ``state_dict`` on every rank (rank order), for the checkpoint.

        The default keeps rank 0's: right for state every rank holds alike (SEE's exchange,
        which every rank receives in full). A callback whose state is split by policy or
        by prompt across ranks overrides this to merge the parts.
        """
        return states[0]


def service_errors(callbacks: list) -> list[str]:
    """Each callback's :attr:`~MRLCallback.requires` that no earlier callback :attr:`~MRLCallback.provides`.

    Returns:
        One message per missing service, naming the callback, the service and the fix.
    """
    errors, provided = [], set()
    for index, cb in enumerate(callbacks):
        for service in getattr(cb, "requires", ()):
            if service not in provided:
                later = any(service in getattr(other, "provides", ()) for other in callbacks[index + 1:])
                who = SERVICE_PROVIDERS.get(service, f"a callback that provides {service!r}")
                fix = f"move {who} before it" if later else f"add {who} before it"
                errors.append(f"{type(cb).__name__} (trainer.callbacks[{index}]) needs {service!r}, which no earlier "
                              f"callback provides: {fix} (callbacks/*.yaml list both).")
        provided.update(getattr(cb, "provides", ()))
    return errors


PER_POLICY_FIELDS = ("lambda_per_policy", "receivers", "sources")
"""The probe options whose values name policies (a mapping by name, or a list of names)."""


def sharing_errors(callbacks: list, policies: list[str],
                   source: Callable[[int, str, str], str | None] = lambda index, field, name: None) -> list[str]:
    """Probe settings that cannot mean anything in this run, found before any model is built (docs/probes.md).

    - A probe that reads other policies' experience (it :attr:`~MRLCallback.requires` the ``exchange``:
      SGT, PRP, XGRPO) in a run of one policy: it would share with nobody, and the run would go on as
      plain GRPO without a word. Refused; the control without sharing is ``callbacks/none.yaml``.
    - A per-policy option (:data:`PER_POLICY_FIELDS`) naming a policy that is not in ``model.policies``
      (a snippet tuned for another config's policies, a typo).
    - The control (:attr:`MRLCallback.is_control`: ``NoSharing``) beside a probe that shares, or one
      callback class listed twice (``--trainer.callbacks+`` of a probe already in the config): a run
      is one arm, and it ran as both without a word.

    Args:
        callbacks: ``trainer.callbacks``, in list order.
        policies: The names of ``model.policies``, in order.
        source: ``(index in trainer.callbacks, field, policy name)`` -> the config file that set that
            name there, or None (the command line, or unknown); named in the message.

    Returns:
        One message per problem, naming the field, the value and the fix.
    """
    errors = []
    names = [type(cb).__name__ for cb in callbacks]
    sharing = [n for n, cb in zip(names, callbacks) if "exchange" in getattr(cb, "requires", ())]
    controls = [n for n, cb in zip(names, callbacks) if getattr(cb, "is_control", False)]
    if controls and sharing:
        errors.append(f"trainer.callbacks has the control {controls[0]} (no sharing) and {', '.join(sharing)}, which "
                      f"shares: a run is one arm. Keep one: callbacks/none.yaml for the control, or the probe's file "
                      f"alone (remove {controls[0]} from trainer.callbacks).")
    for twice in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"trainer.callbacks lists {twice} {names.count(twice)} times: each would act on every step. "
                      f"List it once (a --trainer.callbacks+ of a callback the config already has adds a second).")
    for index, cb in enumerate(callbacks):
        name = type(cb).__name__
        if "exchange" in getattr(cb, "requires", ()) and len(policies) < 2:
            errors.append(f"trainer.callbacks[{index}]: {name} shares experience between policies, but "
                          f"model.policies has {len(policies)} ({policies}): it would share nothing and the run "
                          "would be plain GRPO. Add a policy to model.policies, or use the control without "
                          "sharing, callbacks/none.yaml.")
            continue
        for field_name in PER_POLICY_FIELDS:
            for unknown in [n for n in (getattr(cb, field_name, None) or []) if n not in policies]:
                where = source(index, field_name, unknown)
                fix = (f"; {where!r} was written for another config's policies" if where and
                       Path(where).parent.name == "callbacks" else "")
                near = difflib.get_close_matches(str(unknown), policies, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]!r}? Or" if near else ":"
                errors.append((f"config file {where!r}: " if where else "")
                              + f"trainer.callbacks[{index}].init_args.{field_name} of {name} names policy "
                              f"{unknown!r}, which is not in model.policies {policies}{hint} remove {unknown!r} "
                              f"from {field_name}, or name one of {policies}{fix}.")
    return errors


def collect_services(callbacks: list) -> dict[str, Any]:
    """The services of every provider, by name (a later provider of one name replaces an earlier one)."""
    out: dict[str, Any] = {}
    for cb in callbacks:
        if getattr(cb, "provides", ()):
            out.update(cb.services())
    return out


def prepare_thl(ctx: HookContext, system, receivers: list[str] | None) -> None:
    """Build THL's tables at setup for what this rank will retokenize: the encoder and byte table of each
    receiver it updates (``receivers``: None = every policy), the byte table of every other policy (a
    producer whose ids are mapped from); not in the first step that transfers (:func:`mrl_lightning.thl.prepare`)."""
    workers = getattr(ctx, "workers", None)
    local = set(workers.local_policies) if workers is not None else None
    for name, policy in getattr(system, "policies", {}).items():
        if getattr(policy, "tokenizer", None) is None:
            continue
        receives = (receivers is None or name in receivers) and (local is None or name in local)
        prepare(policy.tokenizer, encoder=receives)
