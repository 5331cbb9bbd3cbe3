"""The policy: one causal LM under GRPO with its own tokenizer, template and objective.

``module`` holds :class:`PolicyModule` (the class a config names as
``mrl_lightning.policy.PolicyModule``), ``sampling`` its completions through a rollout
engine, ``checks`` its config checks that need more than its own fields, ``prompt_fit`` the
check of ``max_prompt_length`` on the data's prompts.
"""

from mrl_lightning.policy.module import PolicyModule

__all__ = ["PolicyModule"]
