"""Building a policy: its model folder (a recipe materializes one), tokenizer, model, reference and vLLM engine.

:mod:`.models` turns a policy's config into weights on this rank; :mod:`.engines` builds a
policy's vLLM engine at its first rollout (and sizes a colocated engine's memory share).
Nothing here runs at import: vLLM and transformers load when a build needs them.
"""

from mrl_lightning.builders.engines import build_vllm_engine
from mrl_lightning.builders.models import build_on_rank, build_policy, materialize, model_config, plan_shapes

__all__ = ["build_on_rank", "build_policy", "build_vllm_engine", "materialize", "model_config", "plan_shapes"]
