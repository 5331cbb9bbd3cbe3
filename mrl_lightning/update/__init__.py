"""One policy's update in one step: the batch it trains on and the optimizer steps on it.

``batch`` (what a policy trains on: ``TrainBatch``, ``ScoredRollouts``, ``AuxiliaryLoss``),
``policy_update`` (``num_iterations`` optimizer steps: GRPO backward per micro-batch, the
auxiliary terms and their bound, the step), ``grpo_terms`` (what the GRPO term needs besides
its loss). Probes hand their terms in through ``batch`` (docs/loop.md).
"""
