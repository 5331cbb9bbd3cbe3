"""SEE: Shared Experience Exchange (docs/see.md): typed records, the exchange buffer, its log."""

from mrl_lightning.exchange.buffer import ExperienceExchange, record_key
from mrl_lightning.exchange.log import read_log
from mrl_lightning.exchange.records import (
    RECORD_TYPES,
    GroupStatsRecord,
    Record,
    RolloutRecord,
    SuccessRecord,
    record_from_dict,
    record_to_dict,
)

__all__ = [
    "ExperienceExchange",
    "GroupStatsRecord",
    "RECORD_TYPES",
    "Record",
    "RolloutRecord",
    "SuccessRecord",
    "read_log",
    "record_from_dict",
    "record_key",
    "record_to_dict",
]
