"""SEE record types (docs/see.md): the typed, versioned contract every probe reads from.

Records are frozen dataclasses holding only JSON-friendly values (str, int, float,
tuples of those) so they can be checkpointed with weights-only loading, written to an
append-only log, and compared for deduplication.

Units: log-probs in nats; ``step`` is the producer's ``rollout_step`` (docs/loop.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Union


@dataclass(frozen=True)
class RolloutRecord:
    """One completion a policy sampled (data-level, read by PRP, docs/probes.md).

    Attributes:
        prompt_id: Stable id of the prompt (same for every policy).
        source: Name of the producing policy.
        step: Producer's ``rollout_step`` when it was sampled.
        completion_text: Decoded completion text (no prompt, no EOS text).
        token_ids: ``[L]`` source-tokenizer ids of the completion (EOS included if sampled).
        logprobs: ``[L]`` float, nats: per-token sampling log-probs (temperature applied).
        offsets: ``[L]`` (start, end) character offsets into ``completion_text``.
        reward: Scalar reward in [0, 1] (NaN when no verifier could score it).
        finish_reason: ``"stop"`` (ended at a stop token) or ``"length"`` (``"eos"`` in older records).
        tokenizer_fingerprint: Hash identifying the source tokenizer.
        sample_index: Index g of the completion in its group (schema 2). Two equal
            completions sampled for one prompt are two samples, not duplicates.
    """

    record_type: ClassVar[str] = "rollout"
    schema_version: ClassVar[int] = 2

    prompt_id: str
    source: str
    step: int
    completion_text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    offsets: tuple[tuple[int, int], ...]
    reward: float
    finish_reason: str
    tokenizer_fingerprint: str
    sample_index: int = 0


@dataclass(frozen=True)
class GroupStatsRecord:
    """Scalar statistics of one policy's group on one prompt (value-level, XGRPO, docs/probes.md).

    Attributes:
        prompt_id: Stable id of the prompt.
        source: Name of the producing policy.
        step: Producer's ``rollout_step``.
        n: Number of scored completions in the group.
        reward_mean: Mean reward of the group.
        reward_std: Standard deviation (Bessel-corrected, as TRL) of the group's rewards.
        success_count: Completions with reward >= the success threshold.
    """

    record_type: ClassVar[str] = "group_stats"
    schema_version: ClassVar[int] = 1

    prompt_id: str
    source: str
    step: int
    n: int
    reward_mean: float
    reward_std: float
    success_count: int


@dataclass(frozen=True)
class SuccessRecord:
    """A verified success (outcome-level, SGT, docs/probes.md). Only a verifier creates these.

    Attributes:
        prompt_id: Stable id of the prompt.
        source: Name of the producing policy.
        step: Producer's ``rollout_step``.
        completion_text: The verified completion text.
        reward: Verifier reward (>= the success threshold).
        verifier: Name of the verifier that checked it.
        verifier_version: Version string of that verifier.
    """

    record_type: ClassVar[str] = "success"
    schema_version: ClassVar[int] = 1

    prompt_id: str
    source: str
    step: int
    completion_text: str
    reward: float
    verifier: str
    verifier_version: str


Record = Union[RolloutRecord, GroupStatsRecord, SuccessRecord]
RECORD_TYPES: dict[str, type] = {
    cls.record_type: cls for cls in (RolloutRecord, GroupStatsRecord, SuccessRecord)
}


# Estimated bytes of one held record (CPython 3.11, 64-bit), fitted with tracemalloc on
# records held by an ExperienceExchange: the record object with its fields, its own prompt id
# string and the exchange's index entries (dedup key, by-type / by-prompt / size maps) cost
# about 1,100 bytes whatever the type; text about a byte a character; a RolloutRecord's
# per-token tuples (id, log-prob float, offset pair) about 120 bytes a token.
RECORD_OVERHEAD_BYTES = 1100
ROLLOUT_TOKEN_BYTES = 120


def record_nbytes(record: Record) -> int:
    """Cheap estimate of the memory one held record costs, in bytes (O(1): lengths only).

    ``RECORD_OVERHEAD_BYTES + len(completion_text) + ROLLOUT_TOKEN_BYTES * len(token_ids)``
    (the last term for RolloutRecords only). Within about 30% of what ``tracemalloc``
    measures for records of 1-32 tokens; used to bound the exchange in bytes
    (``ExperienceExchange(max_bytes=...)``) and logged as ``exchange/bytes_held``.
    """
    text = getattr(record, "completion_text", "")
    tokens = len(getattr(record, "token_ids", ()))
    return RECORD_OVERHEAD_BYTES + len(text) + ROLLOUT_TOKEN_BYTES * tokens


def record_to_dict(record: Record) -> dict[str, Any]:
    """Plain dict with ``record_type`` and ``schema_version`` added (JSON- and checkpoint-safe)."""
    out = {"record_type": record.record_type, "schema_version": record.schema_version}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name == "offsets":
            value = [list(o) for o in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def record_from_dict(data: dict[str, Any]) -> Record:
    """Inverse of :func:`record_to_dict`.

    Raises:
        ValueError: unknown ``record_type`` or a ``schema_version`` newer than this code reads.
    """
    data = dict(data)
    rtype = data.pop("record_type", None)
    version = data.pop("schema_version", 1)
    if rtype not in RECORD_TYPES:
        raise ValueError(f"record_type={rtype!r} is unknown; valid: {sorted(RECORD_TYPES)}")
    cls = RECORD_TYPES[rtype]
    if version > cls.schema_version:
        raise ValueError(
            f"{cls.__name__} schema_version={version} is newer than this code reads "
            f"({cls.schema_version}); upgrade mrl-lightning to read this log."
        )
    if "offsets" in data:
        data["offsets"] = tuple(tuple(o) for o in data["offsets"])
    for key in ("token_ids", "logprobs"):
        if key in data:
            data[key] = tuple(data[key])
    return cls(**data)
