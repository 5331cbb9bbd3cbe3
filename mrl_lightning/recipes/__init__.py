"""Recipes that materialize tiny local models and tokenizers for CPU runs and tests."""

from mrl_lightning.recipes.tiny import TinyCausalLM

__all__ = ["TinyCausalLM"]
