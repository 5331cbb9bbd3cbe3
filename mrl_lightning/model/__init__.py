"""A causal LM as a policy uses it: where it comes from, how it is prompted, its log-probs.

``source`` (a folder, a hub id or a recipe) and ``hub`` (hub ids offline); ``chat`` (chat
templates, one BOS); ``forward``, ``logprobs``, ``head_factors`` and ``weight_casts`` (the
passes that score completions, docs/speed.md); ``numerics`` (non-finite values named or
skipped). Nothing here knows a policy, a loop or a probe (docs/architecture.md).
"""
