"""A large tied head's auxiliary gradient kept as factors gives the materialized gradient's bound and sum."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mrl_lightning.callbacks.sgt_terms import _SGTTransferLoss
from mrl_lightning.model.logprobs import completion_logprobs
from mrl_lightning.model import head_factors
from mrl_lightning.objectives.aux_share import backward_aux_losses

VOCAB, WIDTH = 512, 32


def _policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=0, max_position_embeddings=64)
    model = LlamaForCausalLM(config).train()
    policy = types.SimpleNamespace(model=model, fsdp=False, is_adapter=False)
    policy.completion_logprobs = lambda p, pm, c, cm, model=None, with_entropy=False: completion_logprobs(
        model or policy.model, p, pm, c, cm, temperature=1.0)
    return policy


def _run(policy, factored: bool, grpo_scale: float, demos, mode=None):
    params = [p for p in policy.model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * grpo_scale
    term = _SGTTransferLoss(demos, 0.3, 1.0, "sgt", 0.3, 0)
    weight = head_factors.factorable_weight(policy) if factored else None
    assert (weight is not None) == factored
    with mode or contextlib.nullcontext():
        metrics = backward_aux_losses([term], policy, policy.model, lambda loss: loss.backward(), params,
                                      tag=lambda name: name, totals={"sgt_demos": float(len(demos))},
                                      factored_head=weight)
    return metrics, [p.grad.clone() for p in params]


@pytest.mark.parametrize("grpo_scale", [1e-4, 1.0])  # the bound scales the term / leaves it
def test_factored_head_gives_the_materialized_norm_share_and_update(monkeypatch, grpo_scale):
    monkeypatch.setattr(head_factors, "FACTORED_HEAD_ELEMENTS", 0)  # the tiny tied head counts as large
    policy = _policy()
    demos = [([5, 6, 7, 8], [9, 10, 11, 9, 12]), ([13, 14], [15, 16, 17]), ([5, 6, 7, 8], [18, 19])]
    plain_metrics, plain = _run(policy, False, grpo_scale, demos)
    factored_metrics, factored = _run(policy, True, grpo_scale, demos)
    for key in ("sgt/grad_norm", "sgt/grad_share", "sgt/grad_scale", "sgt/grad_share_raw", "sgt/grpo_grad_norm"):
        assert factored_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-9), key
    if grpo_scale < 1e-3:
        assert plain_metrics["sgt/grad_scale"] < 1.0  # the bound was active
    for a, b in zip(plain, factored):
        assert not b.is_sparse
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert policy.model.get_input_embeddings().sparse is False  # restored after the pass


def test_factored_pass_makes_no_fresh_vocabulary_sized_tensor(monkeypatch):
    from mrl_lightning.objectives import aux_share

    monkeypatch.setattr(head_factors, "FACTORED_HEAD_ELEMENTS", 0)
    monkeypatch.setattr(aux_share, "WHOLE_SUM_ELEMENTS", 1024)  # the norms without a temporary, as a real head's
    policy = _policy()
    demos = [([5, 6, 7, 8], [9, 10, 11, 9, 12])]
    fresh = []

    class Outputs(TorchDispatchMode):  # every op that returns a new dense [V, h] tensor (not a view, not in place)
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inplace = func._schema.name.endswith("_") or "out" in (kwargs or {})
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and tuple(t.shape) == (VOCAB, WIDTH) and not inplace \
                        and not t.is_sparse and not func.is_view:
                    fresh.append(str(func))
            return out

    _run(policy, True, 1e-4, demos, mode=Outputs())
    assert fresh == []
    _run(policy, False, 1e-4, demos, mode=Outputs())  # the materialized pass does make them: the check can fail
    assert fresh


def test_two_terms_of_one_name_factored_then_materialized_sum_as_the_materialized(monkeypatch):
    from mrl_lightning.model import logprobs

    monkeypatch.setattr(head_factors, "FACTORED_HEAD_ELEMENTS", 0)
    monkeypatch.setattr(logprobs, "FACTOR_ELEMENTS", VOCAB * 6)  # a call of more than 6 positions materializes
    policy = _policy()
    small, large = [([5, 6], [9, 10, 11])], [([5, 6, 7], [9, 10, 11, 12]), ([8, 9], [13, 14, 15, 16])]
    results = []
    for factored in (False, True):
        params = [p for p in policy.model.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-4
        terms = [_SGTTransferLoss(d, 0.3, 1.0, "sgt", 0.3, 0) for d in (small, large)]
        metrics = backward_aux_losses(terms, policy, policy.model, lambda loss: loss.backward(), params,
                                      tag=lambda name: name, totals={"sgt_demos": 3.0},
                                      factored_head=head_factors.factorable_weight(policy) if factored else None)
        results.append((metrics, [p.grad.clone() for p in params]))
    (m_a, g_a), (m_b, g_b) = results
    assert m_b["sgt/grad_norm"] == pytest.approx(m_a["sgt/grad_norm"], rel=1e-5)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_a_pass_with_no_counted_position_and_a_float64_model_keep_the_materialized_path(monkeypatch):
    monkeypatch.setattr(head_factors, "FACTORED_HEAD_ELEMENTS", 0)
    policy = _policy()
    weight = head_factors.factorable_weight(policy)
    p_ids, c_ids = torch.tensor([[5, 6, 7]]), torch.tensor([[9, 10]])
    ones, none = torch.ones_like(p_ids, dtype=torch.bool), torch.zeros_like(c_ids, dtype=torch.bool)
    with head_factors.collect(policy, head_factors.HeadFactors(weight)):
        logp, _ = completion_logprobs(policy.model, p_ids, ones, c_ids, none, temperature=1.0)
    assert logp.requires_grad  # the plain computation: a loss of it still backpropagates (to zero)
    assert policy.model.get_input_embeddings().sparse is False
    policy.model.double()
    assert head_factors.factorable_weight(policy) is None  # the factors' sums are float32
