"""``mrl replay``: train some of a run's policies again, the others' SEE records read from the run's exchange log.

A policy trains on what it samples and on the records its peers published; both are functions of step
numbers (docs/mwra.md, "Pace"), and every record a run's exchange accepted is in its log
(``SharedExperienceExchange.log_path``, docs/see.md) with the rollout step that sampled it. So a run can be
repeated for one policy without its peers: the replay runs that policy in one process and, at each step that
samples batch b, hands the exchange the logged policies' records of batch b as the peers' ranks would have
(in the log's order, which is the exchange's), so its weights end equal to the run's and its own log equals
the run's (docs/see.md, "Replay"). The loop treats a logged policy as a disjoint placement treats a policy
on another rank: its tokenizer is built (probes retokenize its completions), its model is not, and it is
not sampled, trained, evaluated or checkpointed here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import read_log
from mrl_lightning.mwra.process import available_cores, omp_threads


class ReplayLog:
    """The logged policies' records of a run's exchange log, by the rollout step that sampled them.

    Args:
        path: The run's exchange log: the JSONL file or Parquet folder its ``SharedExperienceExchange.log_path``
            named (a relative ``log_path`` is inside the run folder).
        policies: Every policy of the config, in ``model.policies`` order.
        replayed: The policies to train again (``--policies``); the others are read from the log.
        max_steps: ``trainer.max_steps`` of the replay (the log must reach it).

    Raises:
        ConfigError: a name in ``replayed`` is not a policy, ``replayed`` is empty or every policy, the log
            cannot be read, holds records of a policy the config lacks (another run's log), holds none of a
            logged policy, or ends before ``max_steps`` (one message, every problem).
    """

    def __init__(self, path: str, policies: Sequence[str], replayed: Sequence[str], max_steps: int) -> None:
        self.path = os.fspath(path)
        self.logged = [p for p in policies if p not in replayed]
        errors = [f"--policies names {name!r}, which is not in model.policies {list(policies)}; name the "
                  "policies to train again." for name in replayed if name not in policies]
        if not replayed or not self.logged:
            errors.append(f"--policies={list(replayed)}: name at least one policy of {list(policies)} to train "
                          "again and leave at least one to be read from the log (to train every policy, mrl fit).")
        if errors:
            raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))
        try:
            records = read_log(self.path)
        except (OSError, ValueError, ImportError) as exc:
            raise ConfigError(f"Invalid replay:\n  - --exchange_log={self.path!r} cannot be read ({exc}); give the "
                              "exchange log the run wrote (SharedExperienceExchange.log_path: a relative one is in "
                              "its run folder, e.g. runs/version_0/exchange.jsonl).") from None
        self.by_step: dict[tuple[str, int], list] = {}
        for record in records:
            if record.source in self.logged:
                self.by_step.setdefault((record.source, record.step), []).append(record)
        self.last_step = max((r.step for r in records), default=0)
        sources = sorted({r.source for r in records} - set(policies))
        if sources:
            errors.append(f"--exchange_log={self.path!r} holds records of {sources}, which this config's "
                          f"model.policies {list(policies)} lack: it is another run's log; give the config the "
                          "run saved (its run folder's config.yaml).")
        empty = [name for name in self.logged if not any(source == name for source, _ in self.by_step)]
        if empty:
            errors.append(f"--exchange_log={self.path!r} holds no record of {empty}: nothing to replay them "
                          "from (was the run's SharedExperienceExchange logging, and did those policies share?).")
        elif max_steps > self.last_step:
            errors.append(f"trainer.max_steps={max_steps}, but --exchange_log={self.path!r} ends at step "
                          f"{self.last_step}; replay at most --trainer.max_steps {self.last_step}.")
        if errors:
            raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))

    def records(self, step: int) -> dict[str, list[list]]:
        """The logged policies' records of batch ``step``, as their ranks hand them to the exchange.

        Returns:
            Policy name -> one list (the log's order) of its records sampled at rollout step ``step``.
        """
        return {name: [list(self.by_step.get((name, step), []))] for name in self.logged}

    def count_through(self, step: int) -> int:
        """How many logged records were sampled at rollout steps 1..``step``."""
        return sum(len(v) for (_, s), v in self.by_step.items() if s <= step)

    def summary(self, step: int) -> str:
        """One line: what was replayed against what (printed when the replay ends)."""
        return (f"Replayed against {self.count_through(step):,} records of {', '.join(map(repr, self.logged))} "
                f"from {self.path} (batches 1-{step}).")


def one_process(trainer: dict) -> tuple[dict, str | None]:
    """The trainer settings of a replay: one process, each policy on the threads a worker of the run had.

    Args:
        trainer: The config's ``trainer`` section as values (``devices``, ``num_nodes``, ``placement``,
            ``policy_ranks``, ``num_threads``).

    Returns:
        ``(changes, note)``: the settings to replace (empty when the config already runs one process) and
        one line saying what was replaced and why (None when nothing was).
    """
    devices, nodes = int(trainer.get("devices") or 1), int(trainer.get("num_nodes") or 1)
    if devices * nodes == 1:
        return {}, None
    changes: dict = {"devices": 1, "num_nodes": 1, "placement": "colocated", "policy_ranks": None}
    if trainer.get("num_threads") is None:  # what each worker of the run had (mwra/plan.py's rule)
        changes["num_threads"] = omp_threads() or max(1, available_cores() // devices)
    was = ", ".join(f"{key} {trainer.get(key)}" for key in changes if trainer.get(key) is not None)
    now = ", ".join(f"{key} {value}" for key, value in changes.items() if value is not None)
    return changes, (f"mrl replay runs in one process: trainer {now} (the run had {was}); its weights equal the "
                     "run's where each policy has the threads it had there (--trainer.num_threads).")


def replay_errors(trainer, model, log: ReplayLog) -> list[str]:
    """What a replay cannot reproduce, found before any model is built (one line each)."""
    errors = []
    if trainer.fabric.world_size > 1:
        errors.append(f"mrl replay runs in one process, but this trainer starts {trainer.fabric.world_size}; give "
                      "trainer.devices 1 and trainer.num_nodes 1 (mrl replay sets them).")
    errors += [f"policy {name!r} has filter_groups: true: its extra prompts moved the shared data stream and no "
               "log holds them, so its peers cannot be replayed without it; train it again too (--policies)."
               for name in log.logged if getattr(model.policies[name], "filter_groups", False)]
    from mrl_lightning.callbacks.exchange import SharedExperienceExchange

    exchange = [cb for cb in trainer.callbacks if isinstance(cb, SharedExperienceExchange)]
    if not exchange:
        errors.append("trainer.callbacks has no SharedExperienceExchange: the logged policies' records would reach "
                      "no one; replay with the config the run saved.")
    elif exchange[0].log_path and os.path.isabs(exchange[0].log_path) and os.path.exists(exchange[0].log_path) \
            and os.path.samefile(exchange[0].log_path, log.path):
        errors.append(f"SharedExperienceExchange.log_path={exchange[0].log_path!r} is the log being replayed: the "
                      "replay would write into it. Give a relative log_path (the replay's own run folder) or "
                      "log_path: null.")
    return errors


class Replay:
    """The ``replay`` subcommand of :class:`~mrl_lightning.loop.trainer.MRLTrainer` (``mrl replay``)."""

    def replay(self, model, datamodule, exchange_log: str, policies: str | list[str],
               ckpt_path: str | None = None) -> None:
        """Train ``policies`` again as in the run that wrote ``exchange_log``, the other policies' SEE records
        read from that log instead of sampled (docs/see.md, "Replay"). One process; ``ckpt_path`` as in ``fit``.

        Args:
            model: The :class:`~mrl_lightning.loop.system.MutualRL` system: the run's config (its ``config.yaml``).
            datamodule: The prompt data module of that config.
            exchange_log: The run's exchange log (``SharedExperienceExchange.log_path``).
            policies: The policy, or list of policies, to train again.
            ckpt_path: A checkpoint to resume from (the replay's own, or the run's: only these policies' parts
                are read).

        Raises:
            ConfigError: the replay cannot reproduce the run (:class:`ReplayLog`, :func:`replay_errors`), before
                any model is built; and whatever ``fit`` raises.
        """
        self.replay_log = log = ReplayLog(exchange_log, list(model.policies),
                                          [policies] if isinstance(policies, str) else list(policies), self.max_steps)
        errors = replay_errors(self, model, log)
        if errors:
            raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))
        self.print(f"mrl replay: training {[p for p in model.policies if p not in log.logged]} again; "
                   f"{log.logged} read from {log.path} ({log.count_through(self.max_steps):,} records), not run.")
        self.fit(model, datamodule, ckpt_path)
        if self.workers is not None:  # (not for a checkpoint that already ends the run)
            self.print(log.summary(self.rollout_step))
