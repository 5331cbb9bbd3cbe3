"""A deterministic test-only reward with variance inside every group.

Random tiny models never solve the task, so every group would have zero variance and
zero gradient. This reward hashes the completion text to {0, 1}, which gives the
policies a real, reproducible learning signal in a 2-step end-to-end run.
"""

import hashlib

from mrl_lightning.rewards.base import RewardFunction


class HashReward(RewardFunction):
    """1.0 when the SHA-256 of the text starts with an even byte, else 0.0."""

    name = "hash"
    version = "1"
    strict = True

    def __call__(self, completions, items):
        return [float(hashlib.sha256(t.encode()).digest()[0] % 2 == 0) for t in completions]


class SparseHashReward(RewardFunction):
    """1.0 when the SHA-256 of the text starts with a byte divisible by 4, else 0.0.

    About a third of four-completion groups then have all-equal rewards (all 0), so dynamic
    sampling (``filter_groups``) has groups to drop and extra batches to draw.
    """

    name = "sparse_hash"
    version = "1"
    strict = True

    def __call__(self, completions, items):
        return [float(hashlib.sha256(t.encode()).digest()[0] % 4 == 0) for t in completions]
