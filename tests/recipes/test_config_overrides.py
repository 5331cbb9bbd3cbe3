"""``TinyCausalLM.config_overrides``: a real model's shape scaled down (MLP ratio, key/value heads, RoPE
base, positions) reaches the built config and the plan's parameter count; mistyped or recipe-owned keys
are refused before anything is built; a prompt plus completion longer than the model's positions is a
config error naming the fix. Parameter counts are worked out by hand."""

from __future__ import annotations

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra.plan import model_shape
from mrl_lightning.recipes import TinyCausalLM

# Width 16, 1 layer, 2 heads of 8, vocabulary 300 (tied embedding 300 * 16 = 4800), overrides
# intermediate_size 48 and num_key_value_heads 2 (the recipe's qwen2 has 1 and an MLP of 32):
#   q 16*16+16 = 272, k 272, v 272 (Qwen2's q/k/v are biased), o 256      -> 1072
#   MLP gate, up 2 * 16*48 = 1536, down 48*16 = 768                       -> 2304
#   2 layer norms 32, final norm 16                                       -> 48
QWEN2_OVERRIDDEN = 4800 + 1072 + 2304 + 48
QWEN2_DEFAULT = 4800 + 2384  # the recipe's own shape (tests/recipes/test_families.py)


def _recipe(family="qwen2", kind="qwen2_bpe", **overrides):
    return TinyCausalLM(family=family, tokenizer_kind=kind, vocab_size=300, hidden_size=16, num_layers=1,
                        num_heads=2, config_overrides=overrides or None)


def test_overrides_reach_the_config_and_the_plans_parameter_count():
    recipe = _recipe(intermediate_size=48, num_key_value_heads=2, max_position_embeddings=1024,
                     rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    config = recipe.model_config()
    assert (config.intermediate_size, config.num_key_value_heads, config.max_position_embeddings) == (48, 2, 1024)
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert model_shape(config).params == QWEN2_OVERRIDDEN
    assert model_shape(_recipe().model_config()).params == QWEN2_DEFAULT


def test_gpt2_positions_are_n_positions():
    # GPT-2 learns one 16-wide vector per position: 512 positions instead of 256 add 256 * 16
    default, longer = _recipe("gpt2", "byte_level_bpe"), _recipe("gpt2", "byte_level_bpe", n_positions=512)
    assert model_shape(longer.model_config()).params - model_shape(default.model_config()).params == 256 * 16


def test_mistyped_and_recipe_owned_keys_are_refused_at_once():
    with pytest.raises(ConfigError) as info:
        _recipe(hidden_size=32, intermediat_size=8, vocab_size=10)
    message = str(info.value)
    assert "config_overrides.hidden_size is set by hidden_size; set it there." in message
    assert "config_overrides.intermediat_size is not a Qwen2Config key; did you mean intermediate_size" in message
    assert "config_overrides.vocab_size is set by the tokenizer; drop it." in message


def test_a_recipe_without_overrides_keeps_its_cache_arguments():
    assert "config_overrides" not in _recipe()._args()  # caches built before the option stay valid
    assert _recipe(intermediate_size=48)._args()["config_overrides"] == {"intermediate_size": 48}


def _policy(recipe, prompt, completion):
    from mrl_lightning.policy import PolicyModule

    return PolicyModule(name="p", model=recipe, max_prompt_length=prompt, max_completion_length=completion)


def test_prompt_and_completion_beyond_the_models_positions_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        _policy(_recipe(), 250, 16)  # the recipe's models take 256 positions
    message = str(info.value)
    assert "max_prompt_length=250 + max_completion_length=16 = 266 tokens, but the model takes 256 positions" in message
    assert "config_overrides: {max_position_embeddings: 266}" in message
    with pytest.raises(ConfigError, match=r"config_overrides: \{n_positions: 300\}"):
        _policy(_recipe("gpt2", "byte_level_bpe"), 296, 4)
    _policy(_recipe(max_position_embeddings=512), 250, 16)  # fits
