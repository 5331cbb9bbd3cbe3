"""The loop: ``MRLTrainer`` running every policy's step, and ``MutualRL`` holding the policies.

``trainer`` (the multi-module Fabric loop: step, counters, evaluation, checkpoints),
``system`` (rollouts and scoring), ``dynamic_sampling`` (DAPO's extra generation batches),
``reporting`` (the scalars and text logged), ``progress`` (console output); docs/loop.md.
"""
