"""THL: Tokenizer Heterogeneity Layer (docs/thl.md).

Retokenize text into a target tokenizer's own ids, recover each token's exact bytes,
align two segmentations on shared byte boundaries, map per-token traces across them,
and measure what the mapping could not keep exact. ``mrl thl`` is :func:`.cli.main`.
"""

from mrl_lightning.thl.align import Alignment, align_bytes, align_lengths, align_offsets
from mrl_lightning.thl.loader import (
    fix_leading_space,
    leading_space_failures,
    load_tokenizer,
)
from mrl_lightning.thl.residual import residual_metrics
from mrl_lightning.thl.retokenize import (
    Retokenized,
    encode_completion,
    prepare,
    retokenize,
    tokenizer_fingerprint,
)
from mrl_lightning.thl.token_bytes import byte_table, decode_completion, token_bytes
from mrl_lightning.thl.trace import (
    MappedTrace,
    conservation_error,
    map_logprobs,
    map_mask,
    map_sequence_advantage,
    map_terminal_reward,
    map_token_advantages,
    map_token_values,
    transfer_trace,
)

__all__ = [
    "Alignment",
    "MappedTrace",
    "Retokenized",
    "align_bytes",
    "align_lengths",
    "align_offsets",
    "byte_table",
    "conservation_error",
    "decode_completion",
    "encode_completion",
    "prepare",
    "fix_leading_space",
    "leading_space_failures",
    "load_tokenizer",
    "map_logprobs",
    "map_mask",
    "map_sequence_advantage",
    "map_terminal_reward",
    "map_token_advantages",
    "map_token_values",
    "residual_metrics",
    "retokenize",
    "token_bytes",
    "tokenizer_fingerprint",
    "transfer_trace",
]
