"""Each GRPO-family member's documented override parses through the CLI and is valid (docs/grpo.md).

The commands are read from docs/grpo.md's "One config per family member" block, so the page
and the test cannot drift apart. Each passes the checks ``mrl fit`` makes before it parses
the config (:func:`mrl_lightning.config.preflight.quick_policy_errors`) and, through LightningCLI's
``--print_config``, lands on the last policy. A loss type with a level TRL warns against,
or an option its loss type does not read, stops with exit status 2 before any model is built.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from mrl_lightning.cli import main
from mrl_lightning.config.preflight import quick_policy_errors

from e2e_configs import forbid_model_build

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- family-overrides -->\n```\n(.*?)```\n<!-- /family-overrides -->", re.S)


def documented_commands() -> list[list[str]]:
    text = (REPO / "docs" / "grpo.md").read_text()
    lines = BLOCK.search(text).group(1).strip().splitlines()
    return [shlex.split(line)[1:] for line in lines]  # after "mrl"


def test_the_page_documents_every_loss_type_and_knob():
    joined = " ".join(" ".join(c) for c in documented_commands())
    for name in ("grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"):
        assert f"loss_type {name}" in joined, name
    for knob in ("importance_sampling_level sequence", "delta", "top_entropy_quantile", "off_policy_mask_threshold",
                 "filter_groups true", "max_num_gen_batches"):
        assert knob in joined, knob


@pytest.mark.parametrize("argv", documented_commands(), ids=lambda a: "+".join(a[4::2]) or "default")
def test_each_documented_member_is_valid_and_lands_on_the_last_policy(argv, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert quick_policy_errors(argv) is None
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--print_config"])
    assert exit_info.value.code in (0, None)
    last = yaml.safe_load(capsys.readouterr().out)["model"]["policies"][-1]["init_args"]
    for key, value in zip(argv[3::2], argv[4::2]):
        assert str(last[key.rsplit(".", 1)[-1]]).lower() == str(yaml.safe_load(value)).lower(), key


@pytest.mark.parametrize("extra, fragment", [
    (["--model.policies.init_args.loss_type", "luspo"], "importance_sampling_level='token' with loss_type='luspo'"),
    (["--model.policies.init_args.importance_sampling_level", "sequence"], "weights each sequence by its completion"),
    (["--model.policies.init_args.sapo_temperature_neg", "2.0"], "is read only by loss_type ['sapo']"),
])
def test_a_bad_family_config_stops_before_any_model_is_built(extra, fragment, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    forbid_model_build(monkeypatch)
    assert main(["fit", "--config", "configs/default.yaml", *extra]) == 2
    assert fragment in capsys.readouterr().err
