"""Workers: what this rank runs and the collectives between ranks (docs/mwra.md).

One :class:`Workers` per process. The loop asks it which policies this rank runs
(:attr:`Workers.local_policies`), which prompts of the step's batch are this rank's
(:meth:`Workers.shard`), and for every exchange between ranks:

- inside a policy's group: sums of loss normalizers (:meth:`group_sum`), the gradient
  all-reduce (:meth:`reduce_gradients`), the initial weight broadcast;
- across the world: SEE records at the step's exchange point (:meth:`exchange`, every
  rank gets every record in one order that does not depend on timing), step metrics
  (:meth:`gather_metrics`, each tag combined by the kind its producer gave it,
  :mod:`mrl_lightning.metrics`), checkpoint state (:meth:`gather_to_zero`).

All of it goes through ``torch.distributed`` (the process group Fabric's strategy set up);
with one process every call returns at once. Each collective is timed (``wait_s``: time
blocked, so a starved or slow worker shows) and a collective that fails or waits past the
timeout raises :class:`WorkerError` naming this rank, the phase and the step, so a run
never hangs silently. :meth:`phase` wraps the loop's phases so that an error raised by
this rank's own code names the rank and phase too. With ``trainer.max_lag`` > 0 the exchange
and the step metrics go through the process group's key-value store instead of a collective
(:mod:`mrl_lightning.loop.pace`), so no rank waits for another there until it is ``max_lag``
steps ahead.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mrl_lightning.metrics import combine_metrics
from mrl_lightning.mwra.placement import Placement, shard_indices


_SOURCE_LOCATION = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")  # gloo's "[/path/pair.cc:553] "


class WorkerError(RuntimeError):
    """A worker failed in one of the loop's phases; the message names the rank, its policies, the phase and the step.

    Attributes:
        rank: The rank that failed.
        phase: The loop's phase (``build``, ``rollout``, ``exchange``, ...).
        step: The step in progress.
    """

    def __init__(self, message: str, rank: int = 0, phase: str = "", step: int = 0) -> None:
        super().__init__(message)
        self.rank, self.phase, self.step = rank, phase, step


class CollectiveError(WorkerError):
    """A collective failed or timed out: another rank failed, ended or hangs (its own error, if any, is its own)."""


class Workers:
    """This rank's view of the placement, and the collectives of the run.

    Args:
        placement: Ranks per policy.
        rank: This process's global rank.
        timeout_s: Collective timeout in seconds (used in messages; the process group
            itself enforces it).

    Raises:
        ValueError: ``placement.world_size`` differs from ``torch.distributed``'s world size.
    """

    def __init__(self, placement: Placement, rank: int = 0, timeout_s: float = 1800.0) -> None:
        self.placement = placement
        self.rank = rank
        self.timeout_s = timeout_s
        self.distributed = placement.world_size > 1
        if self.distributed and dist.get_world_size() != placement.world_size:
            raise ValueError(f"the placement has {placement.world_size} ranks but torch.distributed has "
                             f"{dist.get_world_size()}.")
        self._groups: dict[str, Any] = {}
        self._world = None
        if self.distributed:
            # Every rank creates every group, in the same order (torch.distributed contract). The
            # world group is a new one too: it carries the collective timeout, while the default
            # group keeps the longer rendezvous timeout of start-up.
            self._world = dist.new_group(list(range(placement.world_size)), timeout=_timedelta(timeout_s))
            for name, ranks in placement.groups.items():
                if len(ranks) == placement.world_size:
                    self._groups[name] = self._world
                elif len(ranks) > 1:
                    group = dist.new_group(list(ranks), timeout=_timedelta(timeout_s))
                    self._groups[name] = group if rank in ranks else None
        self.local_policies = placement.policies_on(rank)
        self.phase_name, self.step = "setup", 0
        self.stopped_in: tuple[str, int] | None = None  # (phase, step) the run stopped in, once it has
        self.pace = None  # the lagged exchange (mrl_lightning.loop.pace.Pace), set by the loop
        self.wait_s: dict[str, float] = {}  # seconds blocked since the last take_waits(), by the phase blocked in

    # ------------------------------------------------------------------ topology
    def group_size(self, policy: str) -> int:
        return len(self.placement.groups[policy])

    def group_index(self, policy: str) -> int:
        """This rank's index in ``policy``'s group."""
        return self.placement.groups[policy].index(self.rank)

    def is_leader(self, policy: str) -> bool:
        return self.placement.leader(policy) == self.rank

    def shard_indices(self, policy: str, num_items: int) -> list[int]:
        """The batch positions of this rank's share for ``policy`` (whole prompts, strided: :func:`shard_indices`)."""
        return shard_indices(num_items, self.group_index(policy), self.group_size(policy))

    def shard(self, policy: str, items: list) -> list:
        """This rank's share of ``items`` for ``policy``: every group-size-th prompt from its index."""
        return [items[i] for i in self.shard_indices(policy, len(items))]

    # ---------------------------------------------------------------- collectives
    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        """Name the loop's current phase; an error inside names this rank and the phase."""
        previous = self.phase_name
        self.phase_name = name
        if step is not None:
            self.step = step
        try:
            yield
        except BaseException as exc:
            if self.stopped_in is None:  # the innermost phase an exception (Ctrl-C included) left
                self.stopped_in = (name, self.step)
            if isinstance(exc, (WorkerError, KeyboardInterrupt, SystemExit)) or not isinstance(exc, Exception):
                raise
            if not self.distributed:
                raise
            raise WorkerError(f"rank {self.rank} ({', '.join(self.local_policies)}) failed in phase {name!r} at "
                              f"step {self.step}: {type(exc).__name__}: {exc}", self.rank, name, self.step) from exc
        finally:
            self.phase_name = previous

    def _collective(self, what: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - gloo / nccl errors come in several types
            waited = time.perf_counter() - start
            first = _SOURCE_LOCATION.sub("", str(exc).splitlines()[0]) if str(exc) else ""
            raise CollectiveError(
                f"rank {self.rank} ({', '.join(self.local_policies)}) waited {waited:.1f} s at the {what} collective "
                f"in phase {self.phase_name!r}, step {self.step}, and it failed (timeout {self.timeout_s:.0f} s): "
                f"{type(exc).__name__}: {first}. Another rank failed, ended or hangs; if one only needs longer "
                "(a long warm-start), raise trainer.collective_timeout_s.", self.rank, self.phase_name, self.step
            ) from exc
        finally:
            self.wait_s[self.phase_name] = self.wait_s.get(self.phase_name, 0.0) + time.perf_counter() - start

    def blocking(self, what: str, fn, *args, **kwargs):
        """Call ``fn`` that blocks on other ranks (a store read), timed into :attr:`wait_s` and named on failure.

        Raises:
            CollectiveError: ``fn`` failed or timed out (names this rank, the phase and the step).
        """
        return self._collective(what, fn, *args, **kwargs)

    def _group_all_gather(self, policy: str, obj: Any) -> list[Any]:
        if self.group_size(policy) == 1:
            return [obj]
        out: list[Any] = [None] * self.group_size(policy)
        self._collective(f"{policy} group gather", dist.all_gather_object, out, obj, group=self._groups[policy])
        return out

    def group_sum(self, policy: str, counts: dict[str, float]) -> dict[str, float]:
        """Sum ``counts`` over ``policy``'s group (keys missing on a rank count 0)."""
        total: dict[str, float] = {}
        for part in self._group_all_gather(policy, counts):
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + float(value)
        return total

    def reduce_gradients(self, policy: str, parameters: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``parameters`` over ``policy``'s group, in place (one flat all-reduce).

        Each rank's loss is already divided by the group's totals, so the sum is the
        gradient of the whole batch. Parameters without a gradient count as zeros.
        """
        if self.group_size(policy) == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._collective(f"{policy} gradient", dist.all_reduce, flat, group=self._groups[policy])
        offset = 0
        for p, g in zip(parameters, grads):
            n = g.numel()
            p.grad = flat[offset: offset + n].view_as(g).clone()
            offset += n

    def broadcast_module(self, policy: str, module: torch.nn.Module) -> None:
        """Copy the group leader's parameters and buffers to the rest of ``policy``'s group."""
        if self.group_size(policy) == 1:
            return
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                self._collective(f"{policy} weight broadcast", dist.broadcast, tensor.data,
                                 src=self.placement.leader(policy), group=self._groups[policy])

    def exchange(self, local: dict[str, list[list]]) -> list:
        """Every rank's SEE records, on every rank, in the one order a single rank would produce.

        With ``trainer.max_lag`` L > 0, the records every rank published for the batch this step
        trains instead (:meth:`Pace.exchange <mrl_lightning.loop.pace.Pace.exchange>`; docs/mwra.md, "Pace").

        Args:
            local: Policy name -> this rank's records for it, one list per prompt of its shard
                (in shard order).

        Returns:
            All records, flat: policies in ``model.policies`` order; within a policy, its prompts
            in the step's batch order (each rank's shards interleaved back, :func:`shard_indices`);
            within a prompt, the order its rank produced them.
        """
        if self.pace is not None and self.pace.max_lag:
            return self.pace.exchange(local)
        return self.merge_ranks(self.all_gather(local, "exchange"))

    def merge_ranks(self, gathered: list[dict[str, list[list]]]) -> list:
        """Every rank's ``local`` of :meth:`exchange` (indexed by rank) as one flat list, in its order."""
        out: list = []
        for name, ranks in self.placement.groups.items():
            parts = [gathered[r].get(name, []) for r in ranks]
            for position in range(sum(len(p) for p in parts)):
                out.extend(parts[position % len(ranks)][position // len(ranks)])
        return out

    def process_group(self, policy: str):
        """The ``torch.distributed`` process group of ``policy``'s ranks (this rank must be one of them).

        Raises:
            ValueError: the policy runs on one rank only (it has no group), or not on this rank.
        """
        group = self._groups.get(policy)
        if group is None:
            raise ValueError(f"policy {policy!r} has no process group on rank {self.rank} (a group of "
                             f"{self.group_size(policy)} rank(s): {list(self.placement.groups[policy])}).")
        return group

    def group_gather(self, policy: str, obj: Any) -> list[Any]:
        """``obj`` from every rank of ``policy``'s group, in group order (``[obj]`` on a group of one)."""
        return self._group_all_gather(policy, obj)

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """``obj`` from every rank, indexed by rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.placement.world_size
        self._collective(what, dist.all_gather_object, out, obj, group=self._world)
        return out

    def gather_metrics(self, window: list[dict[str, float]]) -> list[dict[str, float]]:
        """A log window's step metrics from every rank, each step combined over ranks by kind.

        Args:
            window: This rank's metrics of each step of the window, oldest first (every rank
                runs the same steps, so the windows line up).

        Returns:
            One dict per step (:func:`mrl_lightning.metrics.combine_metrics`).
        """
        per_rank = self.all_gather(window, "metrics")
        return [combine_metrics([rank[i] for rank in per_rank]) for i in range(len(window))]

    def group_terms(self, policy: str, terms: list[tuple]) -> list[tuple]:
        """The auxiliary-term names (with their bound and floor: ``(name, *spec)``) of ``policy`` on any rank
        of its group, in rank order of first appearance, so every rank of the group reduces the same terms in
        the same order."""
        out: dict[str, tuple] = {}
        for part in self._group_all_gather(policy, terms):
            for name, *spec in part:
                out.setdefault(name, tuple(spec))
        return [(name, *spec) for name, spec in out.items()]

    def gather_to_zero(self, obj: Any, what: str) -> list[Any] | None:
        """``obj`` from every rank on rank 0 (indexed by rank); None elsewhere."""
        if not self.distributed:
            return [obj]
        out = [None] * self.placement.world_size if self.rank == 0 else None
        self._collective(what, dist.gather_object, obj, out, dst=0, group=self._world)
        return out

    def broadcast_from_zero(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        self._collective(what, dist.broadcast_object_list, box, src=0, group=self._world)
        return box[0]

    def barrier(self, what: str) -> None:
        if self.distributed:
            self._collective(what, dist.barrier, group=self._world)

    def take_waits(self) -> dict[str, float]:
        """Seconds spent blocked on other ranks since the last call, by the loop's phase (``exchange``,
        ``compose``, ``update``, ``metrics``, ...)."""
        waited, self.wait_s = self.wait_s, {}
        return waited


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
