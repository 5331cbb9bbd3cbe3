"""Probes compose in callback-list order (docs/probes.md, "Several probes at once").

XGRPO and PRP replace own-sample advantages (the later one in the list wins); SGT and PRP
append loss terms that add up. The hook is dispatched with Fabric's ``call``, as the
trainer does.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.fabric import Fabric
from test_prp_callback import built, items, make_model_dir, scored_from_texts

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.callbacks import (
    CrossPolicyAdvantage,
    PeerRolloutPooling,
    SharedExperienceExchange,
    SuccessGatedTransfer,
)
from mrl_lightning.objectives.grpo import group_advantages

REPO = Path(__file__).resolve().parents[2]
EPS = 1e-4
VERIFIER = SimpleNamespace(name="exact", version="1")
OWN_TEXTS = [[" 2", " 3", " 4"], [" 3", " 5", " 6"]]
OWN_R = [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]  # prompt 0: own all-fail (SGT rescue, XGRPO signal)
PEER_TEXTS = [[" 1", " 7", " 8"], [" 3", " 21", " 9"]]
PEER_R = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    folder = make_model_dir(tmp_path_factory.mktemp("compose_models"), "gpt2", "byte_level_bpe")
    return {"a": built("a", folder, num_generations=3), "b": built("b", folder, num_generations=3)}


def compose(callbacks, policies, receiver: str = "a") -> TrainBatch:
    """Publish both policies' records, then run ``on_compose_batch`` over ``[SEE] + callbacks``."""
    xs = items(2)
    scored = {"a": scored_from_texts(policies["a"], xs, OWN_TEXTS, OWN_R),
              "b": scored_from_texts(policies["b"], xs, PEER_TEXTS, PEER_R)}
    see = SharedExperienceExchange()
    listed = [see] + list(callbacks)
    trainer = SimpleNamespace(exchange=see.exchange, rollout_step=1, callbacks=listed, print=print)
    system = SimpleNamespace(policies=policies)
    for cb in callbacks:
        assert cb.config_errors(trainer, system) == []
    for name, s in scored.items():
        see.exchange.publish(see.records_for(s, 1, policies[name], VERIFIER))
    own = scored[receiver]
    batch = TrainBatch(own, group_advantages(own.rewards, "group"))
    Fabric(accelerator="cpu", devices=1, callbacks=listed).call("on_compose_batch", trainer, system,
                                                                policies[receiver], batch)
    return batch


@pytest.mark.parametrize("order", ["xgrpo_first", "sgt_first"])
def test_xgrpo_and_sgt_both_act_in_either_order(policies, order):
    xgrpo, sgt = CrossPolicyAdvantage(alpha=0.5, scale_source="union"), SuccessGatedTransfer(lambda_sgt=0.1)
    batch = compose([xgrpo, sgt] if order == "xgrpo_first" else [sgt, xgrpo], policies)
    # XGRPO on prompt 0: own [0, 0, 0] + peer [1, 1, 0]: union mean 1/3, Bessel var (2 (2/3)^2 + 4 (1/3)^2) / 5;
    # b = 0.5 * 0 + 0.5 / 3; own all-fail group gets A = -b / (s + eps) < 0 (plain GRPO: 0).
    s = math.sqrt((2 * (2 / 3) ** 2 + 4 * (1 / 3) ** 2) / 5)
    expected = -(0.5 / 3) / (s + EPS)
    torch.testing.assert_close(batch.advantages[0], torch.full((3,), expected), rtol=0, atol=1e-6)
    # SGT: prompt 0 is in the rescue set; one verified peer success is transferred.
    assert batch.metrics["probe/sgt/a/rescue_set_size"] == 1.0 and batch.metrics["probe/sgt/a/transfers"] == 1.0
    assert [aux.name for aux in batch.aux_losses] == ["sgt"]
    loss, _ = batch.aux_losses[0](policies["a"], policies["a"].model, batch.counts)
    assert torch.isfinite(loss)
    assert "probe/xgrpo/a/baseline_shift" in batch.metrics


def test_later_advantage_probe_wins_and_prp_peer_loss_stays(policies):
    def prp():
        return PeerRolloutPooling(max_peers_per_prompt=3, is_mode="truncate", c=1.0)

    def xgrpo():
        return CrossPolicyAdvantage(alpha=0.5, scale_source="union")  # alpha=1 would equal PRP here

    prp_alone, xgrpo_alone = compose([prp()], policies), compose([xgrpo()], policies)
    assert not torch.allclose(prp_alone.advantages, xgrpo_alone.advantages)
    prp_then_xgrpo = compose([prp(), xgrpo()], policies)
    torch.testing.assert_close(prp_then_xgrpo.advantages, xgrpo_alone.advantages, rtol=0, atol=0)
    assert [aux.name for aux in prp_then_xgrpo.aux_losses] == ["prp"]
    xgrpo_then_prp = compose([xgrpo(), prp()], policies)
    torch.testing.assert_close(xgrpo_then_prp.advantages, prp_alone.advantages, rtol=0, atol=0)
    assert [aux.name for aux in xgrpo_then_prp.aux_losses] == ["prp"]
    # PRP decides even when it finds no peer (its group is then own G: plain GRPO).
    lonely = compose([xgrpo(), PeerRolloutPooling(sources=["a"])], policies)
    torch.testing.assert_close(lonely.advantages, group_advantages(lonely.scored.rewards), rtol=0, atol=0)


def test_prp_and_sgt_loss_terms_add_up(policies):
    batch = compose([PeerRolloutPooling(max_peers_per_prompt=3), SuccessGatedTransfer()], policies)
    assert [aux.name for aux in batch.aux_losses] == ["prp", "sgt"]
    for aux in batch.aux_losses:
        loss, _ = aux(policies["a"], policies["a"].model, batch.counts)
        assert torch.isfinite(loss) and loss.requires_grad


def test_setup_note_names_the_winning_probe_once(capsys):
    prp, xgrpo = PeerRolloutPooling(), CrossPolicyAdvantage()
    trainer = SimpleNamespace(callbacks=[SharedExperienceExchange(), prp, SuccessGatedTransfer(), xgrpo],
                              print=print)
    prp.setup(trainer, None, None)
    xgrpo.setup(trainer, None, None)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[probes]")]
    assert len(lines) == 1 and "CrossPolicyAdvantage's advantages are used" in lines[0]


@pytest.mark.parametrize("snippet,probe", [("prp.yaml", "PeerRolloutPooling"),
                                           ("xgrpo.yaml", "CrossPolicyAdvantage")])
def test_probe_snippet_parses_through_the_cli_on_the_default_config(snippet, probe, capsys, monkeypatch):
    from mrl_lightning.cli import main

    monkeypatch.setattr(sys, "argv", ["mrl"])
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs/default.yaml"), "--config", str(REPO / "callbacks" / snippet),
              "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    callbacks = config["trainer"]["callbacks"]
    assert [c["class_path"].rsplit(".", 1)[1] for c in callbacks] == ["SharedExperienceExchange", probe]
    # The default config lists SGT at the same index; no SGT option may leak into the probe.
    assert callbacks[1]["init_args"].get("lambda_per_policy") is None


@pytest.mark.parametrize("other", [CrossPolicyAdvantage, PeerRolloutPooling])
@pytest.mark.parametrize("sgt_first", [True, False])
def test_sgt_group_mode_beside_an_advantage_probe_is_refused_in_either_order(other, sgt_first):
    """Group mode rewrites the rescued rows' advantages: with XGRPO/PRP one of the two would be
    overwritten while the demos still counted in the normalizers, whichever order."""
    sgt = SuccessGatedTransfer(transfer_mode="group")
    probe = other()
    listed = [SharedExperienceExchange(), sgt, probe] if sgt_first else [SharedExperienceExchange(), probe, sgt]
    system = SimpleNamespace(policies={"a": SimpleNamespace(scale_rewards="group"),
                                       "b": SimpleNamespace(scale_rewards="group")})
    errors = sgt.config_errors(SimpleNamespace(callbacks=listed, placement=None), system)
    assert len(errors) == 1 and "transfer_mode='group'" in errors[0] and other.__name__ in errors[0]
    assert "transfer_mode: nll" in errors[0]
    # nll mode only adds a loss term, and disjoint receivers never meet: both are fine
    nll = SuccessGatedTransfer(transfer_mode="nll")
    assert nll.config_errors(SimpleNamespace(callbacks=[listed[0], nll, probe], placement=None), system) == []
    apart = SuccessGatedTransfer(transfer_mode="group", receivers=["a"])
    probe_b = other(receivers=["b"])
    assert apart.config_errors(SimpleNamespace(callbacks=[listed[0], apart, probe_b], placement=None), system) == []
