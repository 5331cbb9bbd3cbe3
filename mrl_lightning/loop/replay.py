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

import dataclasses
import difflib
import os
import warnings
from collections.abc import Sequence

from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange import read_log, record_key
from mrl_lightning.mwra.process import available_cores, omp_threads


class ReplayMismatch(ConfigError):
    """A replayed policy sampled other records than the run logged for it: the replay does not reproduce the run."""


class ReplayLog:
    """A run's exchange log, by the rollout step that sampled each record: the logged policies' records to hand
    the exchange, and the replayed policies' own to check the replay against.

    Args:
        path: The run's exchange log: the JSONL file or Parquet folder its ``SharedExperienceExchange.log_path``
            named (a relative ``log_path`` is inside the run folder).
        policies: Every policy of the config, in ``model.policies`` order.
        replayed: The policies to train again (``--policies``); the others are read from the log.
        max_steps: ``trainer.max_steps`` of the replay (the log must reach it).
        verify: Check, at every batch, that the replayed policies' records equal theirs in the log
            (:meth:`check`); False for a counterfactual replay (settings of the replayed policy changed).

    Raises:
        ConfigError: a name in ``replayed`` is not a policy, ``replayed`` is empty or every policy, the log
            cannot be read (a folder without Parquet parts included), ends in a torn line before ``max_steps``,
            holds records of a policy the config lacks (another run's log), or ends before ``max_steps``
            (one message, every problem).
    """

    def __init__(self, path: str, policies: Sequence[str], replayed: Sequence[str], max_steps: int,
                 verify: bool = True) -> None:
        self.path, self.verify = os.fspath(path), bool(verify)
        self.logged = [p for p in policies if p not in replayed]
        lowered = {p.lower(): p for p in policies}
        errors = [f"--policies names {name!r}, which is not in model.policies {list(policies)}"
                  + "".join(f"; did you mean {lowered[near]!r}?"
                            for near in difflib.get_close_matches(name.lower(), list(lowered), 1, 0.6))
                  + "; name the policies to train again." for name in replayed if name not in policies]
        if not replayed or not self.logged:
            errors.append(f"--policies={list(replayed)}: name at least one policy of {list(policies)} to train "
                          "again and leave at least one to be read from the log (to train every policy, mrl fit).")
        if errors:
            raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))
        records, torn = _read(self.path)
        self.by_step: dict[tuple[str, int], list] = {}
        for record in records:
            self.by_step.setdefault((record.source, record.step), []).append(record)
        steps = [r.step for r in records]
        self.first_step, self.last_step = min(steps, default=1), max(steps, default=0)
        if torn:  # the run stopped while writing its last step's records: that step may be incomplete
            self.last_step -= 1
        self.read_from: int | None = None  # the first batch this replay sampled
        sources = sorted({r.source for r in records} - set(policies))
        if not records:
            errors.append(f"--exchange_log={self.path!r} holds no record: was the run's SharedExperienceExchange "
                          "logging (its log_path), and is this its log?")
        elif sources:
            errors.append(f"--exchange_log={self.path!r} holds records of {sources}, which this config's "
                          f"model.policies {list(policies)} lack: it is another run's log; give the config the "
                          "run saved (its run folder's config.yaml).")
        elif max_steps > self.last_step:
            why = " (its last line is torn: the run stopped while writing it)" if torn else ""
            errors.append(f"trainer.max_steps={max_steps}, but --exchange_log={self.path!r} holds batches up to "
                          f"{self.last_step}{why}; replay at most --trainer.max_steps {self.last_step}.")
        if errors:
            raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))

    def start_errors(self, resuming: bool) -> list[str]:
        """A log that begins after the replay's first batch (a resumed run's own log), when not resuming."""
        if resuming or self.first_step <= 1:
            return []
        return [f"--exchange_log={self.path!r} begins at batch {self.first_step} (a resumed run's own log: a "
                "relative log_path starts a new one at each resume); replay from the checkpoint that run resumed "
                f"from (--ckpt_path .../step={self.first_step - 1}.ckpt), or give a log of the whole run (an "
                "absolute log_path is one file for a run and its resumes)."]

    def records(self, step: int) -> dict[str, list[list]]:
        """The logged policies' records of batch ``step``, as their ranks hand them to the exchange.

        Returns:
            Policy name -> one list (the log's order) of its records sampled at rollout step ``step``.

        Raises:
            ReplayMismatch: the log begins after batch ``step`` (a resume from an earlier checkpoint).
        """
        if step < self.first_step:
            raise ReplayMismatch(f"mrl replay: batch {step} is sampled, but " + self.start_errors(False)[0])
        if self.read_from is None:
            self.read_from = step
        return {name: [list(self.by_step.get((name, step), []))] for name in self.logged}

    def check(self, step: int, local: dict[str, list[list]]) -> None:
        """Compare the replayed policies' records of batch ``step`` with theirs in the log (when ``verify``).

        Args:
            step: The batch (rollout step) sampled.
            local: Policy name -> its records this step, one list per prompt (the exchange's input).

        Raises:
            ReplayMismatch: a record differs: names the batch, the policy, the record and the field, and
                the causes (another config, seed, lag or threads than the run's; a policy that ran on several
                ranks; dropout; a log of another run). ``--verify false`` replays anyway.
        """
        if not self.verify:
            return
        for name, per_prompt in local.items():
            seen, mine = set(), []
            for record in (r for prompt in per_prompt for r in prompt):  # the exchange drops a repeated record
                if (key := record_key(record)) not in seen:
                    seen.add(key)
                    mine.append(record)
            theirs = self.by_step.get((name, step), [])
            differs = _first_difference(mine, theirs)
            if differs is not None:
                raise ReplayMismatch(
                    f"mrl replay: batch {step} of {name!r} differs from the run's log ({differs}): this replay "
                    "does not reproduce the run. Either the log or --ckpt_path is not that run's (or not whole), or "
                    "the settings differ: replay with the run's config.yaml (seed, max_lag, async_rollouts, steps_per_round) and "
                    "threads (--trainer.num_threads as each of its workers had); a policy that ran on several ranks "
                    "is equal only up to rounding. --verify false trains on anyway (a counterfactual run against "
                    "the same peer records).")

    def count_through(self, step: int) -> int:
        """How many of the logged policies' records were sampled at rollout steps 1..``step``."""
        return sum(len(v) for (name, s), v in self.by_step.items() if s <= step and name in self.logged)

    def summary(self, step: int) -> str:
        """One line: what was replayed against what (printed when the replay ends)."""
        first = self.read_from if self.read_from is not None else step + 1
        read = self.count_through(step) - self.count_through(first - 1)
        checked = "; every batch of the replayed policies equal to the log" if self.verify else ""
        return (f"Replayed against {read:,} records of {', '.join(map(repr, self.logged))} from {self.path} "
                f"(batches {first}-{step}{checked}).")


def _read(path: str) -> tuple[list, bool]:
    """The log's records and whether its last line was torn (:func:`~mrl_lightning.exchange.read_log` warns)."""
    if os.path.isdir(path) and not any(name.endswith(".parquet") for name in os.listdir(path)):
        inside = os.path.join(path, "exchange.jsonl")
        hint = f" (it holds {inside!r})" if os.path.isfile(inside) else ""
        raise ConfigError(f"Invalid replay:\n  - --exchange_log={path!r} is a folder{hint}; give the log file the "
                          "run wrote (SharedExperienceExchange.log_path, e.g. RUN/exchange.jsonl).")
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            records = read_log(path)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"Invalid replay:\n  - --exchange_log={path!r} cannot be read ({exc}); give the "
                          "exchange log the run wrote (SharedExperienceExchange.log_path: a relative one is in "
                          "its run folder, e.g. runs/version_0/exchange.jsonl; the shipped configs write none: "
                          "docs/see.md, \"Replay\").") from None
    return records, any("torn" in str(w.message) for w in said)


def _first_difference(mine: list, theirs: list) -> str | None:
    """Where two lists of records first differ, in words; None when equal."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if record_key(a) != record_key(b):
            where = f"record {i}, a {a.record_type} of prompt {a.prompt_id!r}"
            if type(a) is not type(b) or a.prompt_id != b.prompt_id:
                return f"{where} here, a {b.record_type} of prompt {b.prompt_id!r} in the log"
            field = next(f.name for f in dataclasses.fields(a) if record_key(a) != record_key(
                dataclasses.replace(a, **{f.name: getattr(b, f.name)})))
            mine, theirs = getattr(a, field), getattr(b, field)
            if isinstance(mine, tuple) and isinstance(theirs, tuple) and len(mine) == len(theirs):
                i = next(k for k, (x, y) in enumerate(zip(mine, theirs)) if not (x == y or (x != x and y != y)))
                field, mine, theirs = f"{field}[{i}]", mine[i], theirs[i]
            return f"{where}: {field} {_short(mine)} here, {_short(theirs)} in the log"
    if len(mine) != len(theirs):
        return f"{len(mine)} records here, {len(theirs)} in the log"
    return None


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    out, start = [], steps[0]
    for prev, step in zip(steps, steps[1:] + [None]):
        if step != prev + 1 if step is not None else True:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = step
    return ", ".join(out)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    threads = "each policy on the threads a worker of the run had" if "num_threads" in changes else \
        f"num_threads {trainer.get('num_threads')} as configured"
    return changes, (f"mrl replay runs in one process: trainer {now} (the config gave {was}), {threads}; every "
                     "batch is checked against the log (--verify).")


REPLAY_ONLY = ("exchange_log", "policies", "verify")
"""The replay's own arguments, left out of the ``config.yaml`` it saves (which ``mrl fit --config`` then reads)."""


def override_errors(argv: list[str]) -> list[str]:
    """``mrl replay`` arguments overriding a policy value that reaches a policy the replay reads from the log.

    jsonargparse applies ``--model.policies[.init_args].<key>`` to the list's last policy; under ``mrl replay``
    that policy may be one that does not run, so the override would change nothing, silently.
    """
    if argv[:1] != ["replay"]:
        return []
    from mrl_lightning.config.preflight import _read_argv

    events = _read_argv(argv) or []
    names, replayed, keys = [], [], []
    for key, value in events:
        if key == "config" and isinstance(value.get("model"), dict) and isinstance(value["model"].get("policies"), list):
            names = [(e.get("init_args") or {}).get("name") for e in value["model"]["policies"] if isinstance(e, dict)]
        elif key == "policies":
            replayed = [value] if isinstance(value, str) else list(value or [])
        elif key.startswith("model.policies.init_args."):
            keys.append(key[len("model.policies.init_args."):])
    if not (names and keys and replayed) or names[-1] in replayed:
        return []
    return [f"--model.policies.{key} reaches the last policy of the list, {names[-1]!r}, which mrl replay reads "
            f"from the log and does not run: it would change nothing. To change {replayed[0]!r}, copy the run's "
            "config.yaml, edit its entry there, and replay with --verify false." for key in keys]


def fresh_version(trainer: dict) -> tuple[dict, str | None]:
    """A replay of a run's own ``config.yaml`` names that run's folder (``trainer.version``): the next free one instead.

    Returns:
        ``(changes, note)`` as :func:`one_process`: ``{"version": None}`` and one line when the folder the
        config names already holds a run; else ``({}, None)``.
    """
    version = trainer.get("version")
    folder = os.path.join(str(trainer.get("default_root_dir") or "runs"), f"{version}" if isinstance(version, str)
                          else f"version_{version}")
    if version is None or not os.path.exists(os.path.join(folder, "config.yaml")):
        return {}, None
    return {"version": None}, f"mrl replay: {folder} holds a run (the one replayed?); the replay writes the next free " \
                              "version_<n> beside it (--trainer.version names another)."


def replay_errors(trainer, model, log: ReplayLog) -> list[str]:
    """What a replay cannot reproduce, found before any model is built (one line each)."""
    errors = []
    if trainer.fabric.world_size > 1:
        errors.append(f"mrl replay runs in one process, but this trainer starts {trainer.fabric.world_size}; give "
                      "trainer.devices 1 and trainer.num_nodes 1 (mrl replay sets them).")
    from mrl_lightning.callbacks.exchange import SharedExperienceExchange

    exchange = [cb for cb in trainer.callbacks if isinstance(cb, SharedExperienceExchange)]
    if not exchange:
        errors.append("trainer.callbacks has no SharedExperienceExchange: the logged policies' records would reach "
                      "no one; replay with the config the run saved.")
    elif "group_stats" in exchange[0].record_types or ("rollout" in exchange[0].record_types
                                                        and not exchange[0].rollouts_of_successes_only):
        for name in log.logged:  # such records come with every batch: a batch without any is missing
            missing = [b for b in range(log.first_step, min(trainer.max_steps, log.last_step) + 1)
                       if (name, b) not in log.by_step]
            if missing:
                errors.append(f"--exchange_log={log.path!r} holds no record of {name!r} for batches "
                              f"{_ranges(missing)}, though the run's exchange published some at every batch: the "
                              "log is not whole; give the run's whole log.")
    if exchange and exchange[0].log_path and os.path.isabs(exchange[0].log_path) and os.path.exists(exchange[0].log_path) \
            and os.path.samefile(exchange[0].log_path, log.path):
        errors.append(f"SharedExperienceExchange.log_path={exchange[0].log_path!r} is the log being replayed: the "
                      "replay would write into it. Give a relative log_path (the replay's own run folder) or "
                      "log_path: null.")
    return errors


class Replay:
    """The ``replay`` subcommand of :class:`~mrl_lightning.loop.trainer.MRLTrainer` (``mrl replay``)."""

    def replay(self, model, datamodule, exchange_log: str, policies: str | list[str], verify: bool = True,
               ckpt_path: str | None = None) -> None:
        """Train policies of a run again, their peers' SEE records read from the run's exchange log.

        The other policies do not run; at each batch they hand on what the log holds of it (docs/see.md,
        "Replay"). One process; ``ckpt_path`` as in ``fit``.

        Args:
            model: The :class:`~mrl_lightning.loop.system.MutualRL` system: the run's config (its ``config.yaml``).
            datamodule: The prompt data module of that config.
            exchange_log: The run's exchange log (``SharedExperienceExchange.log_path``).
            policies: The policy, or list of policies, to train again.
            verify: Stop at the first batch where a replayed policy's records differ from the log's (the
                replay would not reproduce the run); False: train on (a counterfactual replay: the replayed
                policy's settings changed, its peers' records as they were).
            ckpt_path: A checkpoint to resume from (the replay's own, or the run's: only these policies' parts
                are read).

        Raises:
            ConfigError: the replay cannot reproduce the run (:class:`ReplayLog`, :func:`replay_errors`), before
                any model is built; and whatever ``fit`` raises.
            ReplayMismatch: with ``verify``, a batch of a replayed policy differs from the log's (:meth:`ReplayLog.check`).
        """
        self.replay_log = log = ReplayLog(exchange_log, list(model.policies),
                                          [policies] if isinstance(policies, str) else list(policies), self.max_steps,
                                          verify)
        errors = replay_errors(self, model, log) + log.start_errors(resuming=ckpt_path is not None)
        if errors:
            raise ConfigError("Invalid replay:\n  - " + "\n  - ".join(errors))
        self.print(f"mrl replay: training {[p for p in model.policies if p not in log.logged]} again; "
                   f"{log.logged} read from {log.path} ({log.count_through(self.max_steps):,} records), not run.")
        self.fit(model, datamodule, ckpt_path)
        if self.workers is not None:  # (not for a checkpoint that already ends the run)
            self.print(log.summary(self.rollout_step))
