"""One policy's training step inside the loop, and the solo steps of ``trainer.steps_per_round`` (docs/mwra.md,
"Steps per round").

:func:`compose_and_update` is what every step runs for each policy of a rank: compose its batch (the probes'
``on_compose_batch``), then its update. :func:`solo_steps` gives a faster policy more training steps than one per
exchange round, in the time it would otherwise wait for its peers: with ``steps_per_round`` k for a policy (k >= 1;
1 = one step per round, as without the option), round r (the step that samples batch r) takes
``floor(r k) - floor((r - 1) k)`` steps of it, one of them the round's shared batch, as every policy's. The others
are *solo steps*, taken first: each samples B prompts of the policy's own draws of the data
(:meth:`~mrl_lightning.data.stream.PromptDataModule.extra_batch`, stream ``solo/<policy>``, a pure function of the
data seed, the round and the step's index in it) and updates on them with its own objective alone. A solo step
publishes nothing and reads nothing: the exchange, the probes (``on_compose_batch``) and every peer see only the
shared batches, as without solo steps, and the shared batch is sampled after the round's solo updates (on-policy in
lockstep). The count, the prompts and every seed are functions of the round, so two runs, one process and several,
and a resume at a round's end are equal.
"""

from __future__ import annotations

import math
import time
from difflib import get_close_matches
from fractions import Fraction
from functools import partial
from typing import Any

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import sampling_rng, stream_seed
from mrl_lightning.mwra.process import release_free_memory
from mrl_lightning.objectives.aux_share import term_names
from mrl_lightning.update.policy_update import new_train_batch, policy_update


def compose_and_update(trainer, model, name: str, scored, keep, metrics: dict[str, float], stream: tuple,
                       hooks: bool = True) -> None:
    """Compose policy ``name``'s batch from ``scored`` and take its update (``num_iterations`` optimizer steps).

    Runs in the policy's own random stream (run seed, policy, ``*stream``), as sampling does: dropout draws do not
    depend on which other policies this process updates (docs/mwra.md, "Reproducibility across placements").

    Args:
        trainer: The :class:`~mrl_lightning.loop.trainer.MRLTrainer` (workers, fabric, modules, hook context).
        model: The :class:`~mrl_lightning.loop.system.MutualRL` system.
        name: The policy.
        scored: This rank's :class:`~mrl_lightning.update.batch.ScoredRollouts` of it.
        keep: ``[groups]`` bool of the groups its GRPO term trains on (DAPO's ``filter_groups``), or None = all.
        metrics: Receives ``train/<p>/*``, ``mwra/<p>/update_s`` (seconds, compose + update) and the batch's.
        stream: Keys of the random stream after the policy's name, e.g. ``("update", global_step)``.
        hooks: Call ``on_compose_batch`` (the probes); False for a solo step.
    """
    w = trainer.workers
    with sampling_rng(stream_seed(trainer._run_seed(), name, *stream)):
        t0 = time.perf_counter()
        policy = model.policies[name]
        with w.phase("compose"):
            batch = new_train_batch(policy, scored, partial(w.group_sum, name), w.group_size(name), keep=keep)
            t1 = time.perf_counter()
            if hooks:
                trainer.fabric.call("on_compose_batch", trainer.ctx, model, policy, batch)
            metrics[f"train/{name}/compose_time_s"] = time.perf_counter() - t1
            batch = batch.for_update()  # the probes saw every group; the GRPO term trains on the kept ones
            batch.group_counts = w.group_sum(name, batch.counts)
            if w.group_size(name) > 1:
                batch.group_terms = w.group_terms(name, term_names(batch.aux_losses))
        with w.phase("update"):
            wrapped, opt = trainer._modules[name]
            reduce = None if policy.fsdp else partial(w.reduce_gradients, name)  # FSDP reduces in backward
            # the last step's gradients go before the forward, and the heap they leave with them
            # (policy_update zeroes them again: a no-op on the first iteration)
            opt.zero_grad(set_to_none=True)
            release_free_memory()
            metrics.update(policy_update(policy, batch, wrapped, trainer.fabric, opt, reduce_gradients=reduce,
                                         gather=partial(w.group_gather, name)))
            release_free_memory()
        metrics.update(batch.metrics)
        metrics[f"train/{name}/update_time_s"] = metrics[f"mwra/{name}/update_s"] = time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ steps per round
def rates(steps_per_round: dict[str, float] | None) -> dict[str, Fraction]:
    """``trainer.steps_per_round`` as exact fractions of its decimal values (1.3 is 13/10, not a binary float), the
    policies above 1 only."""
    exact = {name: Fraction(str(k)) for name, k in (steps_per_round or {}).items()}
    return {name: k for name, k in exact.items() if k > 1}


def solo_count(rate: Fraction | None, round_: int) -> int:
    """Solo steps a policy of ``rate`` steps per round takes in round ``round_`` (from 1):
    ``floor(r k) - floor((r - 1) k) - 1`` (0 for rate None or 1)."""
    if rate is None:
        return 0
    return math.floor(round_ * rate) - math.floor((round_ - 1) * rate) - 1


def steps_per_round_errors(steps_per_round: dict[str, float] | None, policies: dict,
                           async_rollouts: bool) -> list[str]:
    """Bad ``trainer.steps_per_round`` values for these policies (one line each, naming the fix)."""
    errors = []
    for name, k in (steps_per_round or {}).items():
        where = f"trainer.steps_per_round[{name!r}]"
        if name not in policies:
            close = get_close_matches(str(name), list(policies), n=1)
            errors.append(f"{where}: {name!r} is no policy of this run ({', '.join(policies)})"
                          + (f"; did you mean {close[0]!r}?" if close else "."))
            continue
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 1 or k > 64:
            errors.append(f"{where}={'null' if k is None else repr(k)} must be a number from 1 to 64: training steps "
                          f"of {name!r} per exchange "
                          "round, on average (1 = one, as its peers; 1.5 = a second step every other round).")
            continue
        if k > 1 and async_rollouts:
            errors.append(f"{where}={k} gives {name!r} steps of its own between exchanges, but trainer.async_rollouts="
                          "true samples every batch during the update before it; set one of them off.")
        if k > 1 and policies[name].filter_groups:
            errors.append(f"{where}={k}: policy {name!r} has filter_groups: true, whose extra draws a solo step "
                          "would not make; set its steps_per_round to 1 or filter_groups to false.")
    return errors


def check_resume_steps_per_round(counters: dict[str, Any], steps_per_round: dict[str, float] | None,
                                 path: str | None) -> None:
    """Refuse, before any model is built, resuming under other ``steps_per_round`` than the checkpoint's.

    Raises:
        ConfigError: naming both settings and the flag that resumes.
    """
    saved = {name: Fraction(k) for name, k in counters.get("steps_per_round", {}).items()}
    if saved != rates(steps_per_round):
        def said(values: dict) -> str:  # as the flag takes it; "none above 1" for {} and null
            return "{" + ", ".join(f'"{n}": {float(k)!r}' for n, k in values.items()) + "}" if values else "none above 1"

        flag = f"'{said(saved)}'" if saved else "null"
        raise ConfigError(f"trainer.steps_per_round is {said(rates(steps_per_round))} here, but {path} was written "
                          f"with {said(saved)}: how many steps each round takes depends on it. Resume with "
                          f"--trainer.steps_per_round {flag}.")


def rates_line(steps_per_round: dict[str, float] | None) -> str:
    """The plan's line for the rates above 1 ("" without any)."""
    above = rates(steps_per_round)
    return "" if not above else "\nsteps per exchange round: " + ", ".join(
        f"{name} {float(k):g} (its extra steps are solo steps on its own prompts)" for name, k in above.items()) + \
        ", every other policy 1 (docs/mwra.md, \"Steps per round\")"


def round_counters(steps_per_round: dict[str, float] | None) -> dict[str, Any]:
    """What a checkpoint keeps of the setting: the rates above 1, as strings (checkpoints load with weights_only);
    nothing without any, so a run without the option writes the checkpoint it wrote before."""
    above = {name: str(k) for name, k in rates(steps_per_round).items()}
    return {"steps_per_round": above} if above else {}


def solo_steps(trainer, model, datamodule, metrics: dict[str, float]) -> None:
    """Round ``trainer.rollout_step + 1``'s solo steps of every policy this rank runs, before its shared batch.

    Counts every policy's solo steps (``optimizer_steps``, ``samples_seen``) on every rank, as the shared step does.
    Adds, per policy with a rate above 1: ``solo/<p>/steps`` (this round's), the round's last solo step's
    ``rollout/<p>/*`` and ``train/<p>/*`` scalars under ``solo/<p>/`` and ``mwra/<p>/solo_s`` (seconds in solo steps;
    a worker's busy time besides ``rollout_s`` and ``update_s``).
    """
    from mrl_lightning.loop.prefetch import sample_batch

    w, round_ = trainer.workers, trainer.rollout_step + 1
    for name, rate in trainer.solo_rates.items():
        count, policy = solo_count(rate, round_), model.policies[name]
        drawn = [datamodule.extra_batch(f"solo/{name}", round_, j, set()) for j in range(1, count + 1)]
        trainer.optimizer_steps[name] += count * policy.num_iterations
        trainer.samples_seen += sum(len(items) for items in drawn) * policy.num_generations
        if name not in w.local_policies:
            continue
        t0, last = time.perf_counter(), {}
        for j, items in enumerate(drawn, start=1):
            last = {}
            with w.phase("solo", round_):
                _, scored, _, more, _ = sample_batch(trainer, model, datamodule, items, f"solo/{round_}/{j}",
                                                     {name: policy})
                last.update(more)
            compose_and_update(trainer, model, name, scored[name], None, last, ("solo", round_, j), hooks=False)
        metrics.update({f"solo/{name}/{key.split('/', 2)[2]}": value for key, value in last.items()
                        if key.startswith((f"rollout/{name}/", f"train/{name}/"))})
        metrics[f"solo/{name}/steps"] = float(count)
        metrics[f"mwra/{name}/solo_s"] = time.perf_counter() - t0

