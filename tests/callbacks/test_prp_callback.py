"""PeerRolloutPooling callback (docs/probes.md, PRP): pooled advantages, peer loss, logs, equivalences.

Tiny models are built from config with tokenizers trained by ``recipes/tokenizers.py``,
saved with ``save_pretrained`` and loaded back by ``PolicyModule`` via ``from_pretrained``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.builders import build_policy
from mrl_lightning.update.batch import ScoredRollouts, TrainBatch
from mrl_lightning.callbacks import (
    MRLCallback,
    PeerRolloutPooling,
    SharedExperienceExchange,
)
from mrl_lightning.data.items import PromptItem
from mrl_lightning.errors import ConfigError
from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import policy_update
from mrl_lightning.recipes.tokenizers import train_tokenizer
from mrl_lightning.rollout.hf_generate import RolloutBatch, left_pad
from mrl_lightning.thl import retokenize

EPS = 1e-4
CORPUS = [f"What is {a} + {b}?\nAnswer: {a + b}\nQ: {a} - {b}\nA: {a - b}" for a in range(30) for b in range(0, 30, 3)]


def make_model_dir(root, family: str, kind: str, seed: int = 0):
    """A tiny random model of ``family`` with a ``kind`` tokenizer, saved as a HF folder."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    out = root / f"{family}-{kind}-{seed}"
    if out.exists():
        return out
    tok = train_tokenizer(kind, CORPUS, 300, out)
    torch.manual_seed(seed)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                             max_position_embeddings=64, tie_word_embeddings=True, **ids))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prp_models")
    return {"gpt2": make_model_dir(root, "gpt2", "byte_level_bpe"),
            "llama": make_model_dir(root, "llama", "sentencepiece_bpe")}


def built(name: str, folder, **kwargs) -> PolicyModule:
    policy = PolicyModule(name=name, model=str(folder), **kwargs)
    build_policy(policy)
    return policy


def scored_from_texts(policy, items, texts: list[list[str]], rewards: list[list[float]]) -> ScoredRollouts:
    """Rollouts whose ids are THL's canonical encoding of ``texts`` (+ EOS) and whose
    sampling log-probs are the policy's own (as if it had sampled them)."""
    prompts = [policy.render_prompt(x) for x in items]
    rows = [retokenize(policy.tokenizer, prompts[b], t, add_eos=True) for b, group in enumerate(texts) for t in group]
    p_ids, p_mask = left_pad([r.prompt_ids for r in rows], policy.tokenizer.pad_token_id)
    length = max(len(r.completion_ids) for r in rows)
    c_ids = torch.full((len(rows), length), policy.tokenizer.pad_token_id)
    c_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for k, r in enumerate(rows):
        c_ids[k, : len(r.completion_ids)] = torch.tensor(r.completion_ids)
        c_mask[k, : len(r.completion_ids)] = True
    with torch.no_grad():
        old, _ = policy.completion_logprobs(p_ids, p_mask, c_ids, c_mask)
    old = torch.where(c_mask, old, torch.zeros_like(old))
    flat = [t for group in texts for t in group]
    rollouts = RolloutBatch(p_ids, p_mask, c_ids, c_mask, old, ["stop"] * len(rows), flat)
    r = torch.tensor(rewards)
    return ScoredRollouts(policy.policy_name, items, rollouts, r.reshape(-1, 1), r, r >= 1.0, prompts, r.reshape(-1))


def items(n: int) -> list[PromptItem]:
    return [PromptItem(f"add/{i}", f"{i} + {i + 1} = ?", str(2 * i + 1), "add", {}) for i in range(n)]


class _Fabric:
    """Just what ``policy_update`` needs when ``max_grad_norm`` is None."""

    @staticmethod
    def backward(loss):
        loss.backward()


class _KeepGrads:
    """An optimizer that clears gradients but never steps, so they can be read after."""

    def __init__(self, params):
        self.params = list(params)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        return None


def grads_after_update(policy, batch) -> torch.Tensor:
    opt = _KeepGrads(policy.model.parameters())
    metrics = policy_update(policy, batch, policy.model, _Fabric(), opt)
    assert all(math.isfinite(v) for v in metrics.values())
    return torch.cat([p.grad.reshape(-1) for p in opt.params if p.grad is not None])


def compose(probe, receiver, sources: dict, scored: dict, step: int = 1) -> TrainBatch:
    see = SharedExperienceExchange(record_types=["rollout"])
    trainer = SimpleNamespace(exchange=see.exchange, rollout_step=step, callbacks=[see, probe], print=print)
    for name, s in scored.items():
        see.exchange.publish(see.records_for(s, step, sources[name], verifier=None))
    system = SimpleNamespace(policies=sources)
    assert probe.config_errors(trainer, system) == []
    own = scored[receiver.policy_name]
    batch = TrainBatch(own, group_advantages(own.rewards, receiver.scale_rewards))
    probe.on_compose_batch(trainer, system, receiver, batch)
    return batch


OWN_TEXTS = [[" 1", " 2", " 13"], [" 3", " 4", " 5"]]
PEER_TEXTS = [[" 1", " 7", " 8"], [" 3", " 21", " 9"]]  # distinct per prompt (SEE deduplicates)
OWN_R = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
PEER_R = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("is_mode,is_level", [("truncate", "token"), ("clip", "sequence"), ("none", "token")])
def test_identical_policies_same_tokenizer_equal_grpo_with_twice_the_group(model_dirs, loss_type, is_mode, is_level):
    kwargs = dict(num_generations=3, max_grad_norm=None, loss_type=loss_type)
    a = built("a", model_dirs["gpt2"], **kwargs)
    b = built("b", model_dirs["gpt2"], **kwargs)
    xs = items(2)
    scored = {"a": scored_from_texts(a, xs, OWN_TEXTS, OWN_R), "b": scored_from_texts(b, xs, PEER_TEXTS, PEER_R)}
    probe = PeerRolloutPooling(max_peers_per_prompt=3, is_mode=is_mode, is_level=is_level, c=1.0)
    batch = compose(probe, a, {"a": a, "b": b}, scored)
    assert len(batch.aux_losses) == 1
    assert batch.metrics["probe/prp/a/peers_pooled"] == 6.0
    assert batch.metrics["thl/prp/a/boundary_agreement"] == 1.0
    assert batch.metrics["thl/prp/a/round_trip_failures"] == 0.0
    _, metrics = batch.aux_losses[0](a, a.model, batch.counts)  # its first forward gives the receiver's log-probs
    assert metrics["probe/prp/a/log_ratio_abs_max"] < 1e-5  # same model: weights are 1

    # Reference: plain GRPO of policy a on the pooled group of 2G (own then peer per prompt).
    pooled_texts = [o + p for o, p in zip(OWN_TEXTS, PEER_TEXTS)]
    pooled_r = [o + p for o, p in zip(OWN_R, PEER_R)]
    ref = scored_from_texts(a, xs, pooled_texts, pooled_r)
    ref_adv = group_advantages(ref.rewards, "group")
    torch.testing.assert_close(batch.advantages, ref_adv[:, :3], rtol=0, atol=1e-6)
    # By hand, prompt 0: pooled rewards [1, 0, 0, 1, 1, 0]: mean 0.5, Bessel std sqrt(1.5 / 5).
    assert batch.advantages[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.3) + EPS), abs=1e-6)

    grad_prp = grads_after_update(a, batch)
    grad_ref = grads_after_update(a, TrainBatch(ref, ref_adv))
    # The peer term uses the own batch's normalizer: total = (own units + peer units) / own units x pooled GRPO.
    own_mask, ref_mask = scored["a"].rollouts.completion_mask, ref.rollouts.completion_mask
    scale = 2.0 if loss_type == "grpo" else float(ref_mask.sum()) / float(own_mask.sum())
    torch.testing.assert_close(grad_prp, scale * grad_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type, options, sequence_units", [
    ("bnpo", {}, False), ("dr_grpo", {}, True), ("cispo", {"epsilon_high": 5.0}, False),
    ("sapo", {"importance_sampling_level": "sequence"}, True), ("luspo", {"importance_sampling_level": "sequence"}, True),
    ("vespo", {}, False), ("grpo", {"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4}, True),
])
def test_every_loss_type_pools_identical_peers_as_its_own_loss_on_twice_the_group(model_dirs, loss_type, options,
                                                                                 sequence_units):
    """docs/probes.md: PRP's peer unit loss is the receiver's own loss type (cispo, sapo, luspo and vespo as the
    clipped four), so identical peers give (own + peer units) / own units times the policy's own update on the
    pooled group, through the real update."""
    kwargs = dict(num_generations=3, max_grad_norm=None, loss_type=loss_type, **options)
    a = built("a", model_dirs["gpt2"], **kwargs)
    b = built("b", model_dirs["gpt2"], **kwargs)
    xs = items(2)
    scored = {"a": scored_from_texts(a, xs, OWN_TEXTS, OWN_R), "b": scored_from_texts(b, xs, PEER_TEXTS, PEER_R)}
    batch = compose(PeerRolloutPooling(max_peers_per_prompt=3), a, {"a": a, "b": b}, scored)
    assert len(batch.aux_losses) == 1 and batch.metrics["probe/prp/a/peers_pooled"] == 6.0
    pooled_texts = [o + p for o, p in zip(OWN_TEXTS, PEER_TEXTS)]
    ref = scored_from_texts(a, xs, pooled_texts, [o + p for o, p in zip(OWN_R, PEER_R)])
    grad_prp = grads_after_update(a, batch)
    grad_ref = grads_after_update(a, TrainBatch(ref, group_advantages(ref.rewards, "group")))
    own_mask, ref_mask = scored["a"].rollouts.completion_mask, ref.rollouts.completion_mask
    scale = 2.0 if sequence_units else float(ref_mask.sum()) / float(own_mask.sum())
    assert float(grad_ref.abs().max()) > 1e-4
    torch.testing.assert_close(grad_prp, scale * grad_ref, rtol=1e-4, atol=1e-6)


def test_pooled_advantages_replace_own_and_no_peers_leave_grpo(model_dirs):
    a = built("a", model_dirs["gpt2"], num_generations=3)
    b = built("b", model_dirs["gpt2"], num_generations=3)
    xs = items(2)
    scored = {"a": scored_from_texts(a, xs, OWN_TEXTS, OWN_R)}  # the peer published nothing
    batch = compose(PeerRolloutPooling(), a, {"a": a, "b": b}, scored)
    torch.testing.assert_close(batch.advantages, group_advantages(scored["a"].rewards), rtol=0, atol=0)
    assert batch.aux_losses == [] and batch.metrics["probe/prp/a/peers_pooled"] == 0.0
    assert batch.metrics["thl/prp/a/num_sequences"] == 0.0


def test_prompt_without_pooled_peer_keeps_exact_plain_grpo_advantages(model_dirs):
    # The peer published prompt 0 only. Prompt 1's own group is eight 0.3s: plain GRPO gives it
    # exactly 0 (its float32 mean is not 0.3, so a float-mean centering would give ~3e-4).
    a = built("a", model_dirs["gpt2"], num_generations=8)
    b = built("b", model_dirs["gpt2"], num_generations=3)
    xs = items(2)
    own_texts = [[" 1", " 2", " 13", " 6", " 7", " 8", " 9", " 10"], [" 3"] * 8]
    own_r = [[1.0] + [0.0] * 7, [0.3] * 8]
    scored = {"a": scored_from_texts(a, xs, own_texts, own_r),
              "b": scored_from_texts(b, xs[:1], PEER_TEXTS[:1], PEER_R[:1])}
    batch = compose(PeerRolloutPooling(max_peers_per_prompt=3), a, {"a": a, "b": b}, scored)
    assert batch.metrics["probe/prp/a/prompts_with_peers"] == 1.0
    assert torch.equal(batch.advantages[1], torch.zeros(8))
    assert torch.equal(batch.advantages[1], group_advantages(scored["a"].rewards, "group")[1])
    # Prompt 0 is pooled: [1, 0 x 7] + peer [1, 1, 0]: mean 3/11,
    # Bessel var (3 * (8/11)^2 + 8 * (3/11)^2) / 10 = 12/55.
    expected = torch.tensor([8 / 11] + [-3 / 11] * 7) / (math.sqrt(12 / 55) + EPS)
    torch.testing.assert_close(batch.advantages[0], expected, rtol=0, atol=1e-6)


def test_batch_scaled_prompt_without_peer_keeps_the_own_batch_std(model_dirs):
    a = built("a", model_dirs["gpt2"], num_generations=3, scale_rewards="batch")
    b = built("b", model_dirs["gpt2"], num_generations=3)
    xs = items(2)
    own_r = [[1.0, 0.0, 0.0], [1.0, 0.5, 0.0]]
    scored = {"a": scored_from_texts(a, xs, OWN_TEXTS, own_r),
              "b": scored_from_texts(b, xs[:1], PEER_TEXTS[:1], PEER_R[:1])}
    batch = compose(PeerRolloutPooling(max_peers_per_prompt=3), a, {"a": a, "b": b}, scored)
    # Prompt 1 has no peer: plain GRPO's batch std over the six own rewards (sum 2.5, sum of
    # squares 2.25): var = (2.25 - 2.5^2 / 6) / 5; centered [0.5, 0, -0.5].
    own_std = math.sqrt((2.25 - 2.5**2 / 6) / 5)
    torch.testing.assert_close(batch.advantages[1], torch.tensor([0.5, 0.0, -0.5]) / (own_std + EPS),
                               rtol=0, atol=1e-6)
    assert torch.equal(batch.advantages[1], group_advantages(scored["a"].rewards, "batch")[1])
    # Prompt 0 is pooled ([1, 0, 0] + peer [1, 1, 0], mean 0.5) and scaled by the pooled batch's
    # std: the nine rewards [1, 0, 0, 1, 0.5, 0, 1, 1, 0] have mean 0.5, var 8 * 0.25 / 8 = 0.25.
    torch.testing.assert_close(batch.advantages[0], torch.tensor([0.5, -0.5, -0.5]) / (0.5 + EPS),
                               rtol=0, atol=1e-6)


def test_at_most_m_peers_per_prompt_and_receivers_filter(model_dirs):
    a = built("a", model_dirs["gpt2"], num_generations=3)
    b = built("b", model_dirs["gpt2"], num_generations=3)
    xs = items(2)
    scored = {"a": scored_from_texts(a, xs, OWN_TEXTS, OWN_R), "b": scored_from_texts(b, xs, PEER_TEXTS, PEER_R)}
    batch = compose(PeerRolloutPooling(max_peers_per_prompt=2), a, {"a": a, "b": b}, scored)
    assert batch.metrics["probe/prp/a/peers_pooled"] == 4.0
    assert batch.metrics["probe/prp/a/prompts_with_peers"] == 2.0
    skipped = compose(PeerRolloutPooling(receivers=["b"]), a, {"a": a, "b": b}, scored)
    assert skipped.metrics == {} and skipped.aux_losses == []


def test_peer_loss_across_tokenizers_is_finite_and_moves_the_receiver(model_dirs):
    a = built("gpt2", model_dirs["gpt2"], num_generations=3, max_grad_norm=None)
    b = built("llama", model_dirs["llama"], num_generations=3, prompt_template="Q: {question}\nA:")
    xs = items(2)
    peer_texts = [[" 1 is the answer", " 17\n", " 8 + 9"], [" 3", " twenty-one", " 9 ."]]
    scored = {"gpt2": scored_from_texts(a, xs, OWN_TEXTS, [[0.0] * 3, [0.0] * 3]),
              "llama": scored_from_texts(b, xs, peer_texts, PEER_R)}
    for is_mode in ("truncate", "clip", "none"):
        batch = compose(PeerRolloutPooling(max_peers_per_prompt=3, is_mode=is_mode, c=2.0), a,
                        {"gpt2": a, "llama": b}, scored)
        assert batch.metrics["probe/prp/gpt2/peers_pooled"] == 6.0
        assert batch.metrics["thl/prp/gpt2/max_conservation_error"] < 1e-5
        # Own all-fail group on prompt 1, peers with one success: own advantages turn negative.
        assert (batch.advantages[1] < 0).all()
        loss, metrics = batch.aux_losses[0](a, a.model, batch.counts)
        assert torch.isfinite(loss) and math.isfinite(metrics["probe/prp/gpt2/loss"])
        assert 0.0 < metrics["probe/prp/gpt2/ess"] <= 1.0
        grads = grads_after_update(a, batch)
        assert torch.isfinite(grads).all() and grads.abs().sum() > 0


def test_receiver_logprobs_come_from_the_first_forward_and_stay_fixed(model_dirs):
    """``logp_recv`` is the first call's detached forward (bit-equal to a no-gradient pass with the
    weights of that moment) and later inner iterations keep it, whatever the weights are then."""
    a = built("gpt2", model_dirs["gpt2"], num_generations=3, max_grad_norm=None)
    b = built("llama", model_dirs["llama"], num_generations=3, prompt_template="Q: {question}\nA:")
    xs = items(2)
    scored = {"gpt2": scored_from_texts(a, xs, OWN_TEXTS, [[0.0] * 3, [0.0] * 3]),
              "llama": scored_from_texts(b, xs, [[" 1", " 17", " 8"], [" 3", " 21", " 9"]], PEER_R)}
    batch = compose(PeerRolloutPooling(max_peers_per_prompt=3, c=2.0), a, {"gpt2": a, "llama": b}, scored)
    term = batch.aux_losses[0]
    assert "logp_recv" not in term.t  # no forward at compose time
    t = term.t
    with torch.no_grad():
        expected, _ = a.completion_logprobs(t["prompt_ids"], t["prompt_mask"], t["completion_ids"],
                                            t["completion_mask"])
    expected = torch.where(t["completion_mask"], expected, torch.zeros_like(expected))
    _, first = term(a, a.model, batch.counts)
    assert torch.equal(term.t["logp_recv"], expected)
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(0.05)  # an optimizer step in between: the next iteration's forward differs
    _, second = term(a, a.model, batch.counts)
    assert torch.equal(term.t["logp_recv"], expected)
    assert second["probe/prp/gpt2/ess"] == first["probe/prp/gpt2/ess"]
    assert second["probe/prp/gpt2/loss"] != first["probe/prp/gpt2/loss"]


def test_zero_lambda_still_logs_weight_metrics_at_compose(model_dirs):
    a = built("a", model_dirs["gpt2"], num_generations=3)
    b = built("b", model_dirs["gpt2"], num_generations=3)
    xs = items(2)
    scored = {"a": scored_from_texts(a, xs, OWN_TEXTS, OWN_R), "b": scored_from_texts(b, xs, PEER_TEXTS, PEER_R)}
    batch = compose(PeerRolloutPooling(max_peers_per_prompt=3, lambda_prp=0.0), a, {"a": a, "b": b}, scored)
    assert batch.aux_losses == []
    assert batch.metrics["probe/prp/a/log_ratio_abs_max"] < 1e-5 and batch.metrics["probe/prp/a/ess"] > 0.99


def test_invalid_options_are_all_reported_with_valid_choices():
    with pytest.raises(ConfigError) as err:
        PeerRolloutPooling(max_peers_per_prompt=0, is_mode="cap", is_level="word", c=-1.0, lambda_prp=-1.0)
    text = str(err.value)
    for expected in ("max_peers_per_prompt=0", "is_mode='cap'", "truncate", "is_level='word'", "c=-1.0",
                     "lambda_prp"):
        assert expected in text
    with pytest.raises(ConfigError, match="is_mode='clip'"):
        PeerRolloutPooling(is_mode="clip", c=0.5)


def test_config_errors_need_see_and_known_policies():
    from mrl_lightning.callbacks.base import service_errors

    probe = PeerRolloutPooling(receivers=["nope"], lambda_per_policy={"ghost": 0.1})
    ctx = SimpleNamespace(callbacks=[probe], placement=None)
    errors = probe.config_errors(ctx, SimpleNamespace(policies={"a": None, "b": None})) + service_errors([probe])
    assert any("'nope'" in e for e in errors) and any("'ghost'" in e for e in errors)
    assert any("SharedExperienceExchange" in e for e in errors)


def test_end_to_end_two_families_through_the_trainer(model_dirs, tmp_path):
    """Two tiny policies (GPT-2 / byte-level BPE, Llama / SentencePiece BPE) for 2 steps of fit."""
    from mrl_lightning.data.reasoning_gym import ReasoningGymDataModule, TaskPart
    from mrl_lightning.rewards import ReasoningGymAccuracy
    from mrl_lightning.rewards.base import RewardFunction
    from mrl_lightning.loop.system import MutualRL
    from mrl_lightning.loop.trainer import MRLTrainer

    class LengthParity(RewardFunction):
        name = "parity"

        def __call__(self, completions, items_):
            return [float(len(t) % 2) for t in completions]

    class Recorder(MRLCallback):
        def __init__(self):
            self.steps = []

        def on_train_step_end(self, trainer, system, metrics):
            self.steps.append(dict(metrics))

    torch.manual_seed(0)
    policies = [built("gpt2", model_dirs["gpt2"], num_generations=4, max_completion_length=5, temperature=1.5),
                built("llama", model_dirs["llama"], num_generations=4, max_completion_length=5, temperature=1.5,
                      prompt_template="Q: {question}\nA:")]
    before = {p.policy_name: [t.detach().clone() for t in p.model.parameters()] for p in policies}
    system = MutualRL(policies, reward_funcs=[ReasoningGymAccuracy(), LengthParity()])
    part = TaskPart("add", "basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                "operators": ["+"], "allow_parentheses": False,
                                                "allow_negation": False})
    data = ReasoningGymDataModule([part], batch_size=3, train_size=30, eval_size=2)
    recorder = Recorder()
    trainer = MRLTrainer(max_steps=2, default_root_dir=str(tmp_path), log_every_n_steps=1, eval_every_n_steps=100,
                         checkpoint_every_n_steps=0, enable_progress_bar=False, num_threads=1,
                         callbacks=[SharedExperienceExchange(), PeerRolloutPooling(max_peers_per_prompt=4,
                                                                                   is_mode="clip", c=2.0),
                                    recorder])
    trainer.fit(system, data)
    assert len(recorder.steps) == 2
    for name in ("gpt2", "llama"):
        # Random models sample stray byte pieces; THL rejects texts it cannot spell exactly.
        assert sum(m[f"probe/prp/{name}/peers_pooled"] for m in recorder.steps) > 0
        for metrics in recorder.steps:
            assert metrics[f"probe/prp/{name}/peers_pooled"] + metrics[f"probe/prp/{name}/retokenize_failures"] \
                == metrics[f"thl/prp/{name}/num_sequences"]
            keys = [f"train/{name}/loss", f"thl/prp/{name}/boundary_agreement", f"thl/prp/{name}/logprob_mass_moved"]
            if metrics[f"probe/prp/{name}/peers_pooled"]:
                keys += [f"probe/prp/{name}/loss", f"probe/prp/{name}/ess", f"probe/prp/{name}/log_ratio_max"]
            for key in keys:
                assert math.isfinite(metrics[key]), key
    for p in policies:
        assert any(not torch.equal(x, y) for x, y in zip(before[p.policy_name], p.model.parameters()))


def test_batch_scaled_prp_on_several_ranks_of_one_policy_is_refused():
    from types import SimpleNamespace

    from mrl_lightning.callbacks import SharedExperienceExchange

    prp = PeerRolloutPooling()
    policies = {"a": SimpleNamespace(scale_rewards="batch"), "b": SimpleNamespace(scale_rewards="group")}
    system = SimpleNamespace(policies=policies)

    def trainer(world, mode):
        from mrl_lightning.mwra import build_placement

        return SimpleNamespace(callbacks=[SharedExperienceExchange(), prp],
                               placement=build_placement(mode, None, list(policies), world))

    errors = prp.config_errors(trainer(2, "colocated"), system)  # a and b on both ranks
    assert len(errors) == 1 and "policy 'a' has scale_rewards='batch' and 2 data-parallel ranks" in errors[0]
    assert prp.config_errors(trainer(2, "disjoint"), system) == []  # one rank each
    assert prp.config_errors(trainer(1, "colocated"), system) == []


def test_batch_scaled_prp_with_dynamic_sampling_is_refused():
    """PRP recomputes a batch-scaled std over every sampled group; dynamic sampling trains on the kept ones."""
    from types import SimpleNamespace

    prp = PeerRolloutPooling()
    policies = {"a": SimpleNamespace(scale_rewards="batch", filter_groups=True),
                "b": SimpleNamespace(scale_rewards="batch", filter_groups=False),
                "c": SimpleNamespace(scale_rewards="group", filter_groups=True)}
    errors = prp.config_errors(SimpleNamespace(callbacks=[prp], placement=None), SimpleNamespace(policies=policies))
    assert len(errors) == 1 and "policy 'a' has scale_rewards='batch' and filter_groups: true" in errors[0], errors
