"""PolicyModule's GRPO settings are validated at construction (errors name the field, the value and the fix).

A bad value stops with a ConfigError that names the field and the value received, every
problem at once, and before any model is built.
"""

from __future__ import annotations

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.policy import PolicyModule
from mrl_lightning.recipes.tokenizers import train_char_level


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tokenizer folder with pad == eos, one without a pad token, and an (empty) model folder."""
    root = tmp_path_factory.mktemp("policy_config")
    tok = train_char_level(["Calculate 12 + 34.\nAnswer: 46"], root / "tok")
    tok.pad_token = None
    tok.save_pretrained(str(root / "tok_nopad"))
    (root / "model").mkdir()
    return root


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    """Validation must never build a model: loading one fails the test."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded during config validation")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def _make(folders, **overrides):
    kwargs = dict(name="p", model=str(folders / "model"), tokenizer=str(folders / "tok"))
    kwargs.update(overrides)
    return PolicyModule(**kwargs)


def test_valid_config_loads_only_the_tokenizer(folders):
    policy = _make(folders)
    assert policy.model is None
    assert policy.tokenizer.pad_token_id == policy.tokenizer.eos_token_id


@pytest.mark.parametrize("value", [1, 0, -3])
def test_num_generations_below_two_is_rejected_with_field_and_value(folders, value):
    with pytest.raises(ConfigError, match=rf"num_generations={value};.*>= 2"):
        _make(folders, num_generations=value)


def test_unknown_loss_type_lists_the_valid_ones(folders):
    with pytest.raises(ConfigError) as info:
        _make(folders, loss_type="ppo")
    assert "loss_type='ppo'" in str(info.value)
    assert "['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo']" in str(info.value)


def test_unknown_scale_rewards_lists_the_valid_ones(folders):
    with pytest.raises(ConfigError, match=r"scale_rewards='std'; valid: \['group', 'batch', 'none'\]"):
        _make(folders, scale_rewards="std")


def test_missing_local_model_folder_is_named(folders):
    missing = str(folders / "no_such_model")
    with pytest.raises(ConfigError) as info:
        _make(folders, model=missing)
    assert f"model={missing!r} is not an existing folder" in str(info.value)


def test_missing_local_tokenizer_folder_is_named(folders):
    missing = str(folders / "no_such_tokenizer")
    with pytest.raises(ConfigError) as info:
        _make(folders, tokenizer=missing)
    assert f"tokenizer={missing!r} is not an existing folder" in str(info.value)


def test_tokenizer_without_pad_token_is_rejected_with_the_fix(folders):
    nopad = str(folders / "tok_nopad")
    with pytest.raises(ConfigError) as info:
        _make(folders, tokenizer=nopad)
    message = str(info.value)
    assert f"tokenizer {nopad!r} has no pad token" in message
    assert "pad_token:" in message


def test_pad_token_option_repairs_a_tokenizer_without_pad(folders):
    policy = _make(folders, tokenizer=str(folders / "tok_nopad"), pad_token="</s>")
    assert policy.tokenizer.pad_token_id == policy.tokenizer.eos_token_id


def test_several_problems_are_reported_at_once(folders):
    missing = str(folders / "gone")
    with pytest.raises(ConfigError) as info:
        _make(folders, model=missing, tokenizer=str(folders / "tok_nopad"), num_generations=1,
              loss_type="ppo", temperature=0.0, epsilon=-0.1)
    message = str(info.value)
    for fragment in (
        "policy 'p'",
        "num_generations=1",
        "loss_type='ppo'",
        "temperature=0.0",
        "epsilon/epsilon_high must be >= 0",
        f"model={missing!r}",
        "has no pad token",
    ):
        assert fragment in message, fragment
    # One bullet per problem.
    assert message.count("\n  - ") == 6


def test_kl_safety_options_default_to_trl_bias_correction_and_a_20_nat_bound(folders):
    policy = _make(folders)
    assert policy.use_bias_correction_kl is True
    assert policy.kl_log_ratio_clamp == 20.0
    assert _make(folders, kl_log_ratio_clamp=None, use_bias_correction_kl=False).kl_log_ratio_clamp is None


@pytest.mark.parametrize("value", [0.0, -5.0])
def test_non_positive_kl_log_ratio_clamp_is_rejected_with_the_fix(folders, value):
    with pytest.raises(ConfigError, match=rf"kl_log_ratio_clamp={value} must be > 0.*or null"):
        _make(folders, kl_log_ratio_clamp=value)


@pytest.mark.parametrize("loss_type, level, fragment", [
    ("dapo", "sequence", "weights each sequence by its completion length"),
    ("cispo", "sequence", "for GSPO set loss_type: grpo"),
    ("luspo", "token", "set importance_sampling_level: sequence"),
    ("vespo", "sequence", "set importance_sampling_level: token"),
])
def test_an_importance_level_trl_warns_against_is_refused_with_its_reason(folders, loss_type, level, fragment):
    extra = {"epsilon_high": 5.0} if loss_type == "cispo" else {}
    with pytest.raises(ConfigError) as info:
        _make(folders, loss_type=loss_type, importance_sampling_level=level, **extra)
    message = str(info.value)
    assert f"importance_sampling_level={level!r} with loss_type={loss_type!r}" in message and fragment in message


@pytest.mark.parametrize("loss_type, level", [("grpo", "sequence"), ("sapo", "sequence"), ("luspo", "sequence"),
                                              ("sapo", "token"), ("vespo", "token"), ("dapo", "token")])
def test_the_importance_levels_each_loss_type_is_meant_for_are_accepted(folders, loss_type, level):
    assert _make(folders, loss_type=loss_type, importance_sampling_level=level).importance_sampling_level == level


@pytest.mark.parametrize("options, fragment", [
    (dict(loss_type="dapo", sapo_temperature_pos=2.0), "sapo_temperature_pos=2.0 is read only by loss_type ['sapo']"),
    (dict(loss_type="sapo", delta=4.0), "delta=4.0 is read only by loss_type ['grpo', 'bnpo', 'dr_grpo', 'dapo', "
                                        "'luspo']"),
    (dict(loss_type="grpo", vespo_k_neg=1.0), "vespo_k_neg=1.0 is read only by loss_type ['vespo']"),
    (dict(loss_type="vespo", epsilon_high=0.28), "epsilon_high=0.28 is read only by loss_type"),
    (dict(loss_type="cispo"), "set epsilon_high: 5.0"),
    (dict(loss_type="dapo", delta=1.0), "delta=1.0 must be > 1"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg=0.0 must be > 0"),
    (dict(loss_type="vespo", vespo_k_pos=-1.0), "vespo_k_pos=-1.0 must be >= 0"),
    (dict(loss_type="vespo", vespo_lambda_neg=-1.0), "vespo_lambda_neg=-1.0 must be >= 0 (values below 1e-4, 0 "
                                                    "included, are floored at 1e-4"),
    (dict(loss_type="vespo", vllm_importance_sampling_mode="sequence_mask"), "as TRL refuses it"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level='seq'; valid: ['token', 'sequence']"),
    (dict(top_entropy_quantile=1.2), "top_entropy_quantile=1.2 must be in [0, 1]"),
    (dict(off_policy_mask_threshold=0.0), "off_policy_mask_threshold=0.0 must be > 0"),
    (dict(filter_groups=True, max_num_gen_batches=0), "max_num_gen_batches=0 must be an integer >= 1"),
    (dict(max_num_gen_batches=3), "max_num_gen_batches=3 has no effect without filter_groups: true"),
])
def test_an_option_the_loss_type_does_not_read_or_out_of_range_is_named_with_the_fix(folders, options, fragment):
    with pytest.raises(ConfigError) as info:
        _make(folders, **options)
    assert fragment in str(info.value)


@pytest.mark.parametrize("key", ["vespo_lambda_pos", "vespo_lambda_neg"])
def test_a_vespo_lambda_of_zero_is_accepted_and_floored_as_trl_floors_it(folders, key):
    """docs/grpo.md: VESPO's lambda is floored at 1e-4 (TRL clamps it and runs), so 0 is a valid setting;
    its numbers against TRL's: tests/objectives/test_grpo_vs_trl.py."""
    assert getattr(_make(folders, loss_type="vespo", **{key: 0.0}), key) == 0.0


def test_filter_groups_with_fsdp_is_refused(folders):
    with pytest.raises(ConfigError, match="filter_groups=true with fsdp=true is not supported"):
        _make(folders, filter_groups=True, fsdp=True)
