"""SEE: the Shared Experience Exchange buffer (``docs/see.md``).

Policies publish typed records (:mod:`mrl_lightning.exchange.records`); probes read them
back either by ``query`` (stateless: all held records of a type, filtered by receiver,
prompt and staleness) or by ``subscribe`` + ``poll`` (stateful: what is new since the
receiver's last poll). Rules:

- Order: every accepted record gets a sequence number; results are in publication order.
- Deduplication: a record equal to a held one (same type and every field; NaN equals NaN)
  is dropped. A ``SuccessRecord`` with the same ``(prompt_id, source, completion_text)``
  as a held one *refreshes* it when its step is the same or newer: the held record is
  removed and the new one is added at the end of the publication order (so a repeated
  success lives on under staleness windows, and subscribers poll it again); one with an
  older step is dropped. Only the newest record per ``(prompt_id, source, text)`` is held.
- Retention: at most ``capacity`` records and at most ``max_bytes`` estimated bytes
  (:func:`~mrl_lightning.exchange.records.record_nbytes`), the oldest evicted first; after
  ``advance(step)``, only records with ``record.step >= step - max_staleness`` (or the
  window ``max_staleness_by_type`` gives the record's type).
- Own records: a receiver never gets records it produced (``source == receiver``)
  unless ``include_own=True`` in ``query``.
- Thread safety: one lock guards all state; any number of producer threads may publish.
- Checkpointing: ``state_dict`` holds only str/int/float/bool/None/list/dict, so it loads
  with ``torch.load(weights_only=True)``. Capacity, staleness and log settings come from
  ``__init__`` (config), not from the state.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterable, TypeVar

from mrl_lightning.exchange.log import RecordLogWriter, check_log_format
from mrl_lightning.exchange.records import (
    RECORD_TYPES,
    Record,
    SuccessRecord,
    record_from_dict,
    record_nbytes,
    record_to_dict,
)
from mrl_lightning.metrics import Global

R = TypeVar("R")

_STATE_VERSION = 1
_NAN = ("__nan__",)  # stands in for NaN in dedup keys so that NaN == NaN there


def _norm(value: Any) -> Any:
    if isinstance(value, float):
        return _NAN if value != value else value
    if isinstance(value, tuple) and value and isinstance(value[0], float):
        total = sum(value)  # C-speed NaN screen; only a NaN/inf sum pays for the rebuild
        if total != total:
            return tuple(_NAN if v != v else v for v in value)
    return value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def record_key(record: Record) -> tuple:
    """Hashable identity of a record: its type and every field (NaN compares equal).

    Field values are used as they are (tuples included), except that NaN floats are
    replaced by a sentinel, so two records with NaN rewards deduplicate.
    """
    names = _FIELD_NAMES.get(type(record))
    if names is None:  # dataclasses.fields() rebuilds its tuple on every call: once per class
        names = _FIELD_NAMES[type(record)] = tuple(f.name for f in dataclasses.fields(record))
    return (record.record_type,) + tuple([_norm(getattr(record, name)) for name in names])


def _success_key(record: SuccessRecord) -> tuple:
    return (record.prompt_id, record.source, record.completion_text)


def _type_name(record_type: Any, arg: str) -> str:
    name = getattr(record_type, "record_type", None)
    if name not in RECORD_TYPES or RECORD_TYPES[name] is not record_type:
        valid = [cls.__name__ for cls in RECORD_TYPES.values()]
        raise TypeError(f"{arg}={record_type!r} is not a record class; valid: {valid}")
    return name


class ExperienceExchange:
    """In-memory exchange of typed experience records between policies (``docs/see.md``).

    Args:
        capacity: Most records held at once; the oldest are evicted first. Must be >= 1.
        max_staleness: Default staleness window in ``rollout_step`` units: ``advance(step)``
            evicts records with ``record.step < step - max_staleness`` and ``query`` uses it
            when given a ``step``. ``None`` keeps records until capacity evicts them.
        log_path: If set, every accepted record is appended to this log (see
            :mod:`mrl_lightning.exchange.log`; read it back with ``read_log``).
        log_format: ``"jsonl"`` (default) or ``"parquet"`` (needs ``pyarrow``).
        max_bytes: Most estimated bytes held at once (:func:`record_nbytes`); the oldest
            records are evicted first when a publish goes over. ``None`` = no byte bound.
        max_staleness_by_type: Staleness windows for some record types, by type name
            (``"rollout"``, ``"group_stats"``, ``"success"``), replacing ``max_staleness``
            for those types, e.g. ``{"rollout": 0}`` keeps rollouts of the current step only
            while successes stay as long as ``max_staleness`` and the bounds allow.

    Raises:
        ValueError: ``capacity < 1``, ``max_staleness < 0``, ``max_bytes < 1``, an unknown
            type name or a negative window in ``max_staleness_by_type``, or an unknown
            ``log_format`` (all problems reported at once).
        ImportError: ``log_format="parquet"`` without ``pyarrow``.
    """

    def __init__(
        self,
        capacity: int = 100_000,
        max_staleness: int | None = None,
        log_path: str | None = None,
        log_format: str = "jsonl",
        max_bytes: int | None = None,
        max_staleness_by_type: dict[str, int] | None = None,
    ) -> None:
        problems = []
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            problems.append(f"max_bytes={max_bytes!r} must be None or an int >= 1 (bytes)")
        for name, window in (max_staleness_by_type or {}).items():
            if name not in RECORD_TYPES:
                problems.append(f"max_staleness_by_type has unknown record type {name!r}; "
                                f"valid: {sorted(RECORD_TYPES)}")
            elif isinstance(window, bool) or not isinstance(window, int) or window < 0:
                problems.append(f"max_staleness_by_type[{name!r}]={window!r} must be an int >= 0")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            problems.append(f"capacity={capacity!r} must be an int >= 1")
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
        ):
            problems.append(f"max_staleness={max_staleness!r} must be None or an int >= 0")
        try:
            check_log_format(log_format)
        except ValueError as err:
            problems.append(str(err))
        if problems:
            raise ValueError("ExperienceExchange: " + "; ".join(problems))
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.max_bytes = max_bytes
        self.max_staleness_by_type = dict(max_staleness_by_type or {})
        self.log_path = log_path
        self.log_format = log_format
        self._log = RecordLogWriter(log_path, log_format) if log_path is not None else None
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self._records: dict[int, Record] = {}  # seq -> record, insertion (= publication) order
        self._by_type: dict[str, dict[int, Record]] = {name: {} for name in RECORD_TYPES}
        self._by_prompt: dict[tuple[str, str], dict[int, Record]] = {}
        self._keys: dict[tuple, int] = {}  # record_key -> seq
        self._seq_keys: dict[int, tuple] = {}  # seq -> record_key (so eviction needs no rehash)
        self._success_keys: dict[tuple, int] = {}  # (prompt_id, source, text) -> seq
        self._nbytes: dict[int, int] = {}  # seq -> estimated bytes
        self._bytes_held = 0
        self._next_seq = 0
        self._current_step: int | None = None
        self._subscriptions: dict[str, list[str]] = {}
        self._cursors: dict[str, int] = {}  # receiver -> last seq it has seen
        self._counters: dict[str, int] = {
            "records_published": 0,
            "duplicates_dropped": 0,
            "evicted_stale": 0,
            "evicted_capacity": 0,
            "evicted_bytes": 0,
            "successes_refreshed": 0,
        }
        self._published_by_type: dict[str, int] = {name: 0 for name in RECORD_TYPES}

    # ------------------------------------------------------------------ writing
    def publish(self, records: Iterable[Record]) -> int:
        """Add records; duplicates are dropped, repeated successes refresh (see module docstring).

        Thread-safe. Every accepted record (a refreshing success included) goes to the log.

        Args:
            records: Records of any of the record classes, in the producer's order.

        Returns:
            The number of records accepted.

        Raises:
            TypeError: an item is not a record instance (names its index and type); nothing
                is published in that case.
        """
        items = list(records)
        for i, rec in enumerate(items):
            if type(rec) not in RECORD_TYPES.values():
                valid = [cls.__name__ for cls in RECORD_TYPES.values()]
                raise TypeError(
                    f"publish: records[{i}] is a {type(rec).__name__}, not a record; valid: {valid}"
                )
        with self._lock:
            accepted: list[Record] = []
            first_seq = self._next_seq
            for rec in items:
                key = record_key(rec)
                skey = _success_key(rec) if isinstance(rec, SuccessRecord) else None
                held = self._success_keys.get(skey) if skey is not None else None
                if key in self._keys or (held is not None and rec.step < self._records[held].step):
                    self._counters["duplicates_dropped"] += 1
                    continue
                if held is not None:  # the same success again, as new or newer: newest step wins
                    self._evict(held)
                    self._counters["successes_refreshed"] += 1
                seq = self._next_seq
                self._next_seq += 1
                self._hold(seq, rec, key)
                self._counters["records_published"] += 1
                self._published_by_type[rec.record_type] += 1
                accepted.append(rec)
            if self._log is not None and accepted:
                self._log.append(accepted, first_seq)
            self._enforce_bounds()
            return len(accepted)

    def _hold(self, seq: int, rec: Record, key: tuple) -> None:
        """Add ``rec`` under ``seq`` to the records and every index (caller holds the lock)."""
        self._records[seq] = rec
        self._by_type[rec.record_type][seq] = rec
        self._by_prompt.setdefault((rec.record_type, rec.prompt_id), {})[seq] = rec
        self._keys[key] = seq
        self._seq_keys[seq] = key
        if isinstance(rec, SuccessRecord):
            self._success_keys[_success_key(rec)] = seq  # publication order: the newest is last
        self._nbytes[seq] = size = record_nbytes(rec)
        self._bytes_held += size

    def _enforce_bounds(self) -> None:
        """Evict the oldest records while over ``capacity`` or ``max_bytes`` (counted apart)."""
        overflow = len(self._records) - self.capacity
        if overflow > 0:
            for seq in list(self._records)[:overflow]:
                self._evict(seq)
            self._counters["evicted_capacity"] += overflow
        if self.max_bytes is not None and self._bytes_held > self.max_bytes:
            for seq in list(self._records):  # oldest first; one pass, not a scan per eviction
                if self._bytes_held <= self.max_bytes:
                    break
                self._evict(seq)
                self._counters["evicted_bytes"] += 1

    def _evict(self, seq: int) -> None:
        self._bytes_held -= self._nbytes.pop(seq)
        rec = self._records.pop(seq)
        del self._by_type[rec.record_type][seq]
        bucket = self._by_prompt[(rec.record_type, rec.prompt_id)]
        del bucket[seq]
        if not bucket:
            del self._by_prompt[(rec.record_type, rec.prompt_id)]
        del self._keys[self._seq_keys.pop(seq)]
        if isinstance(rec, SuccessRecord) and self._success_keys.get(_success_key(rec)) == seq:
            del self._success_keys[_success_key(rec)]

    def advance(self, step: int) -> int:
        """Set the current step and evict records older than ``max_staleness`` before it.

        Args:
            step: The current ``rollout_step``.

        Returns:
            How many records were evicted (0 when no staleness window is set).
        """
        with self._lock:
            self._current_step = int(step)
            windows = {name: self.max_staleness_by_type.get(name, self.max_staleness) for name in RECORD_TYPES}
            if all(w is None for w in windows.values()):
                return 0
            oldest = {name: None if w is None else step - w for name, w in windows.items()}
            stale = [seq for seq, rec in self._records.items()
                     if oldest[rec.record_type] is not None and rec.step < oldest[rec.record_type]]
            for seq in stale:
                self._evict(seq)
            self._counters["evicted_stale"] += len(stale)
            return len(stale)

    # ------------------------------------------------------------------ reading
    def query(
        self,
        record_type: type[R],
        *,
        receiver: str | None = None,
        step: int | None = None,
        prompt_ids: Iterable[str] | None = None,
        max_staleness: int | None = None,
        include_own: bool = False,
    ) -> list[R]:
        """Held records of one type, in publication order.

        Args:
            record_type: ``RolloutRecord``, ``GroupStatsRecord`` or ``SuccessRecord``.
            receiver: Name of the asking policy; its own records (``source == receiver``)
                are left out unless ``include_own``. ``None`` returns every source.
            step: Current ``rollout_step``; with a staleness window only records with
                ``record.step >= step - staleness`` are returned.
            prompt_ids: Only records for these prompts.
            max_staleness: Window for this query; ``None`` uses the exchange's.
            include_own: Also return the receiver's own records.

        Returns:
            The matching records (the held objects; they are frozen).

        Raises:
            TypeError: ``record_type`` is not a record class.
            ValueError: ``max_staleness < 0``.
        """
        name = _type_name(record_type, "record_type")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"query: max_staleness={max_staleness!r} must be None or >= 0")
        window = self.max_staleness if max_staleness is None else max_staleness
        oldest = step - window if (step is not None and window is not None) else None
        with self._lock:
            if prompt_ids is None:
                candidates = list(self._by_type[name].items())
            else:
                candidates = []
                for pid in dict.fromkeys(prompt_ids):
                    candidates.extend(self._by_prompt.get((name, pid), {}).items())
                candidates.sort(key=lambda item: item[0])
        return [
            rec
            for _, rec in candidates
            if (include_own or receiver is None or rec.source != receiver)
            and (oldest is None or rec.step >= oldest)
        ]

    def subscribe(self, receiver: str, record_types: Iterable[type]) -> None:
        """Register ``receiver`` for ``record_types`` (added to any earlier subscription).

        A receiver's first ``poll`` returns every held record of its types, so a late
        subscriber catches up on what is still held.

        Raises:
            TypeError: an entry of ``record_types`` is not a record class.
            ValueError: ``receiver`` is empty or not a str.
        """
        if not isinstance(receiver, str) or not receiver:
            raise ValueError(f"subscribe: receiver={receiver!r} must be a non-empty str")
        names = [_type_name(t, "record_types entry") for t in record_types]
        with self._lock:
            current = self._subscriptions.setdefault(receiver, [])
            current.extend(n for n in names if n not in current)
            self._cursors.setdefault(receiver, -1)

    def poll(self, receiver: str) -> list[Record]:
        """Records published since ``receiver``'s last poll, of its subscribed types, not its own.

        Records evicted before a poll are not returned.

        Raises:
            ValueError: ``receiver`` never subscribed (call ``subscribe`` first).
        """
        with self._lock:
            if receiver not in self._subscriptions:
                raise ValueError(
                    f"poll: receiver={receiver!r} has no subscription; call "
                    f"subscribe({receiver!r}, [RecordType, ...]) first. Subscribed: "
                    f"{sorted(self._subscriptions)}"
                )
            cursor = self._cursors[receiver]
            types = set(self._subscriptions[receiver])
            out = [
                rec
                for seq, rec in self._records.items()
                if seq > cursor and rec.record_type in types and rec.source != receiver
            ]
            self._cursors[receiver] = self._next_seq - 1
            return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def metrics(self) -> dict[str, float]:
        """Counters under ``exchange/``: cumulative counts and what is held now.

        Keys: ``exchange/records_published``, ``exchange/records_held``,
        ``exchange/bytes_held`` (estimated memory of the held records, :func:`record_nbytes`),
        ``exchange/duplicates_dropped``, ``exchange/evicted_stale``,
        ``exchange/evicted_capacity``, ``exchange/evicted_bytes`` (records evicted by
        ``max_bytes``), ``exchange/successes_refreshed`` (held successes
        replaced by the same success at the same or a newer step), ``exchange/subscribers``
        and, per record type ``T`` in (rollout, group_stats, success),
        ``exchange/T_published`` and ``exchange/T_held``; each a :class:`~mrl_lightning.metrics.Global`.
        """
        with self._lock:  # every rank holds the same exchange: Global (logged as the window's last value)
            out = {f"exchange/{k}": Global(v) for k, v in self._counters.items()}
            out["exchange/records_held"] = Global(len(self._records))
            out["exchange/bytes_held"] = Global(self._bytes_held)
            out["exchange/subscribers"] = Global(len(self._subscriptions))
            for name in RECORD_TYPES:
                out[f"exchange/{name}_published"] = Global(self._published_by_type[name])
                out[f"exchange/{name}_held"] = Global(len(self._by_type[name]))
            return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: records with their sequence numbers, counters,
        subscriptions, poll cursors and the current step. Plain Python values only."""
        with self._lock:
            return {
                "version": _STATE_VERSION,
                "records": [[seq, record_to_dict(rec)] for seq, rec in self._records.items()],
                "next_seq": self._next_seq,
                "current_step": self._current_step,
                "counters": dict(self._counters),
                "published_by_type": dict(self._published_by_type),
                "subscriptions": {k: list(v) for k, v in self._subscriptions.items()},
                "cursors": dict(self._cursors),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this exchange's contents with ``state`` (from :meth:`state_dict`).

        Config (capacity, byte bound, staleness, log) stays as given to ``__init__``; if the
        state holds more records than ``capacity`` or more bytes than ``max_bytes`` the
        oldest are evicted (and counted). Loading writes nothing to the log, but a JSONL log
        that already holds records published after this state (a run killed after its last
        checkpoint, resumed into the same log file) has them cut off before the next append,
        so the log stays the history of the records this exchange accepted.

        Raises:
            ValueError: ``state`` has an unknown ``version`` or holds an invalid record.
        """
        version = state.get("version")
        if version != _STATE_VERSION:
            raise ValueError(
                f"load_state_dict: state version={version!r} is not readable; valid: "
                f"[{_STATE_VERSION}]. Was it saved by ExperienceExchange.state_dict?"
            )
        with self._lock:
            self._reset()
            for seq, data in state["records"]:
                rec = record_from_dict(data)
                self._hold(int(seq), rec, record_key(rec))
            self._next_seq = int(state["next_seq"])
            self._current_step = state["current_step"]
            self._counters.update({k: int(v) for k, v in state["counters"].items()})
            self._published_by_type.update({k: int(v) for k, v in state["published_by_type"].items()})
            self._subscriptions = {k: list(v) for k, v in state["subscriptions"].items()}
            self._cursors = {k: int(v) for k, v in state["cursors"].items()}
            self._enforce_bounds()
            if self._log is not None and self._current_step is not None:
                self._log.rollback(self._current_step)
