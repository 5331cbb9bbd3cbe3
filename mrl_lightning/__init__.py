"""mrl-lightning: Mutual Reinforcement Learning for heterogeneous language models.

Several policies of different model families, each with its own weights, tokenizer
and GRPO objective, trained together and exchanging typed experience (docs/README.md).
"""

__version__ = "0.1.0"
