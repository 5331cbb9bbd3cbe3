"""Pace: how far one policy may run ahead of its peers, and what each step reads (docs/mwra.md, "Pace").

With ``trainer.max_lag`` = L = 0 (lockstep) every step's SEE records meet in one world
collective and every rank waits there for the slowest. With L > 0 a step samples batch s and
trains batch s - L, by a rule of step numbers, never of timing: every rank publishes the records
of the batch it sampled and receives those every policy published for the batch it trains, in
the order the lockstep exchange gives (:meth:`Workers.merge_ranks
<mrl_lightning.mwra.Workers.merge_ranks>`). What a step reads is therefore the same in two runs,
in 1 process or several, and after a resume; a rank blocks only when a peer has not yet
sampled the batch it trains, so it runs at most L batches ahead of the slowest.

Transport: the key-value store of the process group Fabric set up (``torch.distributed``'s
TCPStore; ``set`` and a blocking ``get`` under ``mrl/pace/see/<step>/<rank>``), so no world
collective stands in the step; one process keeps the steps in a dict. The step metrics go the
same way (``log/<step>/<rank>``): rank 0 logs a log step once every rank has published it, and
the rest at each checkpoint and at the end, so no rank waits for the logger. Evaluation and
checkpoints stay collectives: every rank meets there at the same step. A checkpoint after update c keeps the batches in
flight (c + 1 .. c + L, sampled, not yet trained) and their records.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mrl_lightning.errors import ConfigError
from mrl_lightning.exchange.records import record_from_dict, record_to_dict
from mrl_lightning.run.checkpoint import CheckpointError
from mrl_lightning.update.policy_update import mark_for_rescoring
from mrl_lightning.metrics import Max, combine_metrics, window_reduce


class Pace:
    """The lagged exchange and the store-borne step metrics of one rank (module docstring).

    Args:
        workers: This rank's :class:`~mrl_lightning.mwra.Workers` (placement, rank, timing of waits).
        max_lag: L, in steps (``trainer.max_lag``); 0 = lockstep, and nothing here is used.
        timeout_s: How long a store read waits for a peer before the run stops with an error
            naming the rank and phase (``trainer.collective_timeout_s``).
        device: This rank's device: a resumed batch in flight goes back to it.
        log: ``fabric.log_dict``: how rank 0 logs a window (``log(metrics, step=step)``).
    """

    def __init__(self, workers, max_lag: int, timeout_s: float, device=None, log=None) -> None:
        self.workers, self.max_lag, self.timeout = workers, int(max_lag), timedelta(seconds=timeout_s)
        self.device, self.log = device, log
        self.started: float | None = None  # the first step's start (train/elapsed_s counts from it)
        self.sampled_after: dict[int, int] = {}  # batch in flight -> updates done when it was sampled
        self.published: set[int] = set()  # batches whose records this rank sent (none without an exchange)
        self.store = None
        if max_lag and workers.distributed:  # a private accessor, public since torch 2.0 in all but name
            self.store = dist.PrefixStore("mrl/pace/", dist.distributed_c10d._get_default_store())
        self._local: dict[str, Any] = {}  # one process: the store's keys
        self.resumed: dict[int, list] = {}  # step -> records of it, from a checkpoint
        self._logs: list[int] = []  # rank 0: log steps published, not yet logged
        self.in_flight: dict[int, tuple[dict, dict]] = {}  # batch -> ({policy: ScoredRollouts}, {policy: kept})
        self.publish_step: int | None = None  # the batch this step sampled (its records go out)
        self.training: int | None = None  # the batch this step trains, if any
        self.async_rollouts = False  # trainer.async_rollouts (set by the loop): every batch re-scored too

    # ---------------------------------------------------------------- schedule
    def begin(self) -> float:
        """A step starts: its ``time.perf_counter()`` (the first one's is what ``train/elapsed_s`` counts from)."""
        now = time.perf_counter()
        self.started = now if self.started is None else self.started
        return now

    def queue(self, rollout_step: int, max_steps: int, sampled: tuple[dict, dict] | None,
              global_step: int = 0) -> int | None:
        """Hold the batch this step sampled (``rollout_step``, if ``sampled``); return the batch to train now.

        Lockstep trains the batch just sampled. With L > 0 the oldest held batch trains once L newer
        ones are sampled, or once every batch is (``rollout_step == max_steps``): step s samples
        batch s and trains batch s - L. None = nothing to train yet (the first L steps).
        """
        self.publish_step, self.training = (rollout_step if sampled is not None else None), None
        if sampled is not None:
            self.in_flight[rollout_step], self.sampled_after[rollout_step] = sampled, global_step
        oldest = min(self.in_flight, default=None)
        if oldest is None or (rollout_step - oldest < self.max_lag and rollout_step < max_steps):
            return None
        self.training = oldest
        return oldest

    def take(self, batch: int, metrics: dict[str, float], global_step: int = 0) -> tuple[dict, dict]:
        """The held batch ``batch``, to train now (``global_step``: updates done). With a lag it was sampled by older
        weights: the update re-scores it and weights each token by the truncated importance ratio to the sampler
        (``vllm_importance_sampling_*``); ``pace/staleness_steps`` (updates since it was sampled) is logged."""
        scored, keep = self.in_flight.pop(batch)
        sampled_after = self.sampled_after.pop(batch, global_step)
        if self.max_lag or self.async_rollouts:  # (async_rollouts: sampled during the update before, trainer.py)
            for one in scored.values():
                mark_for_rescoring(one.rollouts)
            metrics["pace/staleness_steps"] = float(global_step - sampled_after)
        return scored, keep

    # --------------------------------------------------------------- transport
    def _set(self, key: str, obj: Any) -> None:
        if self.store is None:
            self._local[key] = obj
        else:
            self.store.set(key, pickle.dumps(obj))

    def _get(self, key: str, what: str, keep: bool = False) -> Any:
        if self.store is None:  # one process: its only reader reads a step once
            return self._local[key] if keep else self._local.pop(key)
        self.workers.blocking(what, self.store.wait, [key], self.timeout)
        return pickle.loads(self.store.get(key))

    def _ready(self, key: str) -> bool:
        return self.store.check([key])

    def _delete(self, key: str) -> None:
        if self.store is not None:
            self.store.delete_key(key)

    # ---------------------------------------------------------------- exchange
    def exchange(self, local: dict[str, list[list]]) -> list:
        """Publish this rank's records of the batch this step sampled; return every rank's of the batch it trains.

        Args:
            local: Policy name -> this rank's records, one list per prompt of its shard.

        Returns:
            The records of batch :attr:`training` of every rank, flat, in lockstep's order; [] on a
            step that trains nothing.

        Raises:
            CollectiveError: a peer did not publish that batch within ``collective_timeout_s``.
        """
        w = self.workers
        if self.publish_step is not None:
            self._set(f"see/{self.publish_step}/{w.rank}", local)
            self.published.add(self.publish_step)
        read = self.training
        if read is None:  # nothing to train this step
            return []
        if read in self.resumed:
            records = self.resumed.pop(read)
        else:
            records = w.merge_ranks([self._get(f"see/{read}/{r}", "lagged exchange")
                                     for r in range(w.placement.world_size)])
        # every peer has published step `read`, so it has read every step before read - L: keys of those go
        if self.store is not None and read - self.max_lag - 1 >= 1:
            self._delete(f"see/{read - self.max_lag - 1}/{w.rank}")
        return records

    def pending(self) -> dict[int, list]:
        """The records of the batches in flight, which later steps still read: kept in a checkpoint."""
        w = self.workers
        out: dict[int, list] = {}
        for t in sorted(self.in_flight):
            if t in self.resumed:
                out[t] = self.resumed[t]
            elif t in self.published:  # (every rank runs the same callbacks: with no exchange, none published)
                out[t] = w.merge_ranks([self._get(f"see/{t}/{r}", "checkpoint", keep=True)
                                        for r in range(w.placement.world_size)])
        return out

    def load(self, counters: dict[str, Any]) -> None:
        """Take the batches in flight and their records from a checkpoint's counters (a lockstep one has none).

        Raises:
            CheckpointError: a policy's batches in flight were sampled on another number of ranks.
        """
        self.resumed = {int(t): [record_from_dict(r) for r in records]
                        for t, records in counters.get("exchange_pending", {}).items()}
        held, after = counters.get("in_flight", {}), counters.get("sampled_after", {})
        w = self.workers
        for t in sorted(held):
            parts = {}
            for name in w.local_policies:
                key = _shard_key(w, name)
                if key not in held.get(t, {}):
                    raise CheckpointError(f"the checkpoint holds batch {t} of {name!r} sampled on another placement "
                                          f"(no part {key!r}); resume a run with trainer.max_lag > 0 on the "
                                          "placement it was written with.")
                parts[name] = held[t][key]
            self.sampled_after[t] = int(after.get(t, 0))
            self.in_flight[t] = ({n: scored_from_state(p["scored"], self.device) for n, p in parts.items()},
                                 {n: p["keep"] for n, p in parts.items() if p["keep"] is not None})

    def counters(self) -> dict[str, Any]:
        """What a checkpoint adds to its counters: the batches in flight and their records (nothing in lockstep).

        A collective (every rank's batches go to rank 0); plain values, as checkpoints load with weights_only.
        """
        if not self.max_lag:
            return {}
        self.flush()  # rank 0 logs every window up to here: a kill after the checkpoint loses none
        w = self.workers
        mine = {t: {_shard_key(w, name): {"scored": scored_state(scored[name]),
                                          "keep": keep.get(name)}
                    for name in scored} for t, (scored, keep) in self.in_flight.items()}
        held: dict[int, dict] = {}
        for part in w.gather_to_zero(mine, "checkpoint") or []:
            for t, shards in part.items():
                held.setdefault(t, {}).update(shards)
        return {"max_lag": self.max_lag, "in_flight": held, "sampled_after": dict(self.sampled_after),
                "exchange_pending": {t: [record_to_dict(r) for r in recs] for t, recs in self.pending().items()}}

    # ----------------------------------------------------------------- metrics
    def log_window(self, step: int, window: list[dict[str, float]]) -> list[dict[str, float]]:
        """Log this rank's metrics of the window ending at ``step`` (combined over ranks, on rank 0).

        Lockstep gathers the window over ranks (a collective). With a lag each rank publishes
        its window, and rank 0 logs the windows every rank has published, oldest first.

        Returns:
            The combined metrics logged now (empty on other ranks, and while a peer is behind).
        """
        w = self.workers
        if not self.max_lag or self.store is None:
            ready = [(step, window_reduce(w.gather_metrics(window)))]
        else:
            self._set(f"log/{step}/{w.rank}", window)
            if w.rank == 0:
                self._logs.append(step)
            ready = self._logs_ready(block=False)
        for at, logged in ready:
            self.log(logged, step=at)
        return [logged for _, logged in ready]

    def flush(self) -> list[dict[str, float]]:
        """Rank 0 logs every window not yet logged, waiting for the peers' (at a checkpoint and at the end); returns
        the combined metrics it logged, oldest first."""
        ready = self._logs_ready(block=True) if self.store is not None else []
        for at, logged in ready:
            self.log(logged, step=at)
        return [logged for _, logged in ready]

    def _logs_ready(self, block: bool) -> list[tuple[int, dict[str, float]]]:
        ranks, out = range(self.workers.placement.world_size), []
        while self._logs and (block or all(self._ready(f"log/{self._logs[0]}/{r}") for r in ranks)):
            step = self._logs.pop(0)
            per_rank = [self._get(f"log/{step}/{r}", "metrics") for r in ranks]
            for r in ranks:
                self._delete(f"log/{step}/{r}")
            out.append((step, window_reduce([combine_metrics([rank[i] for rank in per_rank])
                                             for i in range(len(per_rank[0]))])))
        return out


def check_resume_lag(counters: dict[str, Any], max_lag: int, path: str | None, placement=None) -> None:
    """Refuse, before any model is built, a checkpoint written under another ``max_lag``, or one whose batches in
    flight were sampled on another number of ranks per policy than ``placement`` gives (each rank kept its share).

    Raises:
        ConfigError: naming the setting, its value and the fix.
    """
    saved = int(counters.get("max_lag", 0))
    if saved != max_lag:
        raise ConfigError(f"trainer.max_lag={max_lag}, but {path} was written with max_lag={saved}: what each step "
                          f"reads from the exchange depends on it. Resume with --trainer.max_lag {saved}.")
    sampled_on = {key.rpartition("/")[0]: int(key.rpartition("of")[2])
                  for shards in counters.get("in_flight", {}).values() for key in shards}
    for name, ranks in sampled_on.items():
        now = len(placement.groups.get(name, ())) if placement is not None else ranks
        if now != ranks:
            raise ConfigError(
                f"{path} holds batches of {name!r} sampled but not yet trained (trainer.max_lag={max_lag}), each "
                f"rank's share kept, from {ranks} rank(s); this run gives {name!r} {now}. Resume with {ranks} rank(s) "
                f"for it (trainer.devices, trainer.placement, trainer.policy_ranks).")


def step_wait_metrics(policies: list[str], before: dict[str, float], waits: dict[str, float], step_time_s: float,
                      peak_gib: float, pace: Pace) -> dict[str, float]:
    """Where this rank's step went (docs/mwra.md, "Pace": the tags), for each policy it runs.

    Args:
        policies: This rank's policies.
        before: :meth:`Workers.take_waits` at the step's start: ``metrics`` is the gather of the
            log step just before it (lockstep); evaluation and checkpoint waits are left out.
        waits: :meth:`Workers.take_waits` at the step's end, by phase (seconds).
        step_time_s: The step's wall time, seconds (``train/step_time_s``).
        peak_gib: This process's peak memory, GiB.
        pace: This rank's :class:`Pace` (its start time).

    Returns:
        ``mwra/<policy>/wait_s`` (every second blocked on another rank in the step and the log
        gather before it), ``wait_exchange_s`` (the exchange), ``wait_update_s`` (the policy
        group's sums and gradient reduce), ``wait_rollout_s`` (dynamic sampling's count of extra
        prompts over every rank), ``wait_log_s`` (the log gather), ``idle_share``
        (wait_s over the step's wall time plus that gather), ``peak_memory_gib``; and
        ``train/elapsed_s``, seconds since the first step began when the step's update ended (the
        latest over ranks), so a step's wall time needs no logging time (with a lag, rank 0 logs late).
    """
    log = before.get("metrics", 0.0)
    total = sum(waits.values()) + log
    out: dict[str, float] = {}
    for name in policies:
        out.update({f"mwra/{name}/wait_s": total, f"mwra/{name}/wait_exchange_s": waits.get("exchange", 0.0),
                    f"mwra/{name}/wait_update_s": waits.get("compose", 0.0) + waits.get("update", 0.0),
                    f"mwra/{name}/wait_rollout_s": waits.get("rollout", 0.0),
                    f"mwra/{name}/wait_log_s": log, f"mwra/{name}/idle_share": total / max(step_time_s + log, 1e-9),
                    f"mwra/{name}/peak_memory_gib": Max(peak_gib)})
    now = time.perf_counter()
    out["train/elapsed_s"] = Max(now - (now if pace.started is None else pace.started))
    return out


def _shard_key(workers, policy: str) -> str:
    return f"{policy}/{workers.group_index(policy)}of{workers.group_size(policy)}"


def _cpu(obj: Any, moved: list[str], name: str) -> Any:
    if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
        moved.append(name)
        return obj.cpu()
    return obj


def scored_state(scored) -> dict[str, Any]:
    """A :class:`~mrl_lightning.update.batch.ScoredRollouts` as plain values and CPU tensors (for a checkpoint);
    ``on_device`` names the tensors that were on an accelerator."""
    moved: list[str] = []
    out = {f.name: _cpu(getattr(scored, f.name), moved, f.name) for f in dataclasses.fields(scored)}
    out["items"] = [dataclasses.asdict(item) for item in scored.items]
    out["rollouts"] = {f.name: _cpu(getattr(scored.rollouts, f.name), moved, f"rollouts.{f.name}")
                       for f in dataclasses.fields(scored.rollouts)}
    out["on_device"] = moved
    return out


def scored_from_state(state: dict[str, Any], device=None):
    """The :class:`~mrl_lightning.update.batch.ScoredRollouts` :func:`scored_state` wrote, its accelerator tensors
    on ``device`` (this rank's)."""
    from mrl_lightning.data.items import PromptItem
    from mrl_lightning.rollout.base import RolloutBatch
    from mrl_lightning.update.batch import ScoredRollouts

    state = {**state, "rollouts": dict(state["rollouts"])}
    for name in state.pop("on_device", []):
        where = state["rollouts"] if name.startswith("rollouts.") else state
        key = name.removeprefix("rollouts.")
        where[key] = where[key].to(device) if device is not None else where[key]
    return ScoredRollouts(**{**state, "items": [PromptItem(**item) for item in state["items"]],
                             "rollouts": RolloutBatch(**state["rollouts"])})


def lag_errors(max_lag: int, policies: dict) -> list[str]:
    """Settings that cannot train on batches sampled ``max_lag`` updates before (one line each)."""
    return [f"trainer.max_lag={max_lag} trains each batch {max_lag} updates after it was sampled, but policy "
            f"{name!r} has vllm_importance_sampling_correction=false, which leaves that staleness uncorrected; set it "
            "true (the default) or --trainer.max_lag 0 (docs/mwra.md, \"Pace\")."
            for name, policy in policies.items()
            if max_lag and not getattr(policy, "vllm_importance_sampling_correction", True)]
