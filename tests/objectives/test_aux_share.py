"""An auxiliary loss's share of the update, and its bound (mrl_lightning/objectives/aux_share.py).

grad_share_k = ||g_k|| / (||g_0|| + ||g_k||) with g_0 the GRPO gradient; a term over its bound
b is scaled by s_k = b / (1 - b) * ||g_0|| / ||g_k||. Expected values worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from mrl_lightning.update.batch import AuxiliaryLoss
from mrl_lightning.objectives.aux_share import backward_aux_losses, share_scale


@pytest.mark.parametrize(
    "main, term, bound, share, scale",
    [
        (3.0, 4.0, None, 4 / 7, 1.0),            # no bound: share only
        (3.0, 4.0, 0.6, 4 / 7, 1.0),             # 0.571 <= 0.6: untouched
        (3.0, 4.0, 0.25, 4 / 7, 0.25),           # s = 0.25/0.75 * 3/4 = 0.25
        (3.0, 9.0, 0.5, 0.75, 1 / 3),            # s = 1 * 3/9: the term ends as large as g_0
        (0.0, 2.0, 0.5, 1.0, 0.0),               # no GRPO signal: a bounded term is dropped
        (0.0, 0.0, 0.5, 0.0, 1.0),               # nothing at all
    ],
)
def test_share_and_scale_by_hand(main, term, bound, share, scale):
    got_share, got_scale = share_scale(main, term, bound)
    assert got_share == pytest.approx(share) and got_scale == pytest.approx(scale)


@pytest.mark.parametrize("bound", [0.0, 1.0, -0.1, 1.5])
def test_bound_outside_zero_one_is_refused(bound):
    with pytest.raises(ValueError, match=f"max_grad_share={bound!r} must be in \\(0, 1\\)"):
        share_scale(1.0, 1.0, bound)


class _Term(AuxiliaryLoss):
    def __init__(self, name, fn, max_grad_share=None):
        self.name, self.fn, self.max_grad_share = name, fn, max_grad_share
        self.totals_seen = []

    def __call__(self, policy, model, totals):
        self.totals_seen.append(totals)
        return self.fn(model), {f"probe/{self.name}/p/loss": 1.0}


def _toy(terms):
    """w = [w1, w2]; GRPO loss 3*w1 (g_0 = [3, 0]) already backpropagated, then the terms."""
    w = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    (3.0 * w[0]).backward()
    metrics = backward_aux_losses(terms, None, w, lambda loss: loss.backward(), [w], tag=lambda n: f"probe/{n}/p")
    return w.grad, metrics


def test_unbounded_term_adds_its_gradient_and_reports_its_share():
    grad, metrics = _toy([_Term("sgt", lambda w: 4.0 * w[1])])
    assert grad.tolist() == [3.0, 4.0]
    assert metrics["probe/sgt/p/grad_share"] == pytest.approx(4 / 7)
    assert metrics["probe/sgt/p/grad_share_raw"] == pytest.approx(4 / 7)
    assert metrics["probe/sgt/p/grad_norm"] == pytest.approx(4.0)
    assert metrics["probe/sgt/p/grpo_grad_norm"] == pytest.approx(3.0)
    assert metrics["probe/sgt/p/grad_scale"] == 1.0 and metrics["probe/sgt/p/loss"] == 1.0


def test_bounded_term_is_scaled_to_its_bound():
    grad, metrics = _toy([_Term("sgt", lambda w: 4.0 * w[1], max_grad_share=0.25)])
    assert grad.tolist() == pytest.approx([3.0, 1.0])  # 4 * s with s = 0.25
    assert metrics["probe/sgt/p/grad_share"] == pytest.approx(0.25)  # 1 / (3 + 1)
    assert metrics["probe/sgt/p/grad_share_raw"] == pytest.approx(4 / 7)
    assert metrics["probe/sgt/p/grad_scale"] == pytest.approx(0.25)


def test_terms_are_measured_each_against_grpo_and_summed_by_name():
    # two "sgt" terms on w2 (3 + 1 = 4 -> share 4/7, bound 0.6 not hit) and a "prp" term on
    # w1 (12, against ||g_0|| = 3: share 0.8 > 0.5, s = 1 * 3/12 = 0.25 -> 3)
    terms = [_Term("sgt", lambda w: 3.0 * w[1], 0.6), _Term("prp", lambda w: 12.0 * w[0], 0.5),
             _Term("sgt", lambda w: 1.0 * w[1], 0.6)]
    grad, metrics = _toy(terms)
    assert grad.tolist() == pytest.approx([3.0 + 3.0, 4.0])
    assert metrics["probe/sgt/p/grad_share"] == pytest.approx(4 / 7)
    assert metrics["probe/prp/p/grad_share_raw"] == pytest.approx(0.8)
    assert metrics["probe/prp/p/grad_share"] == pytest.approx(0.5)


def test_norm_is_over_all_parameters():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1))
    (a.sum() * 0.0 + 1.0 * a[0]).backward()  # g_0 = ([1, 0], None)
    term = _Term("sgt", lambda _: 2.0 * a[1] + 2.0 * b[0])  # g = ([0, 2], [2]) -> norm sqrt(8)
    metrics = backward_aux_losses([term], None, None, lambda loss: loss.backward(), [a, b], tag=lambda n: n)
    assert metrics["sgt/grad_norm"] == pytest.approx(math.sqrt(8))
    assert metrics["sgt/grad_share"] == pytest.approx(math.sqrt(8) / (1 + math.sqrt(8)))
    assert a.grad.tolist() == [1.0, 2.0] and b.grad.tolist() == [2.0]


def test_the_bound_is_measured_on_the_groups_gradient_not_this_ranks():
    """Two ranks of one policy: rank A holds the GRPO signal (g_0 = [3, 0]) and no transfer; rank B
    holds the transfer (g_k = [0, 4]) and no GRPO signal. One rank on the whole batch sees both: share
    4/7 > 0.25, so s = 0.25/0.75 * 3/4 = 0.25 and the update is [3, 1]. Each rank, given the group's
    reduction, must take that step; measured on its own gradients alone, rank B would drop the
    transfer (its ||g_0|| is 0) and rank A would see no term at all."""
    w_a = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    w_b = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    w_a.grad = torch.tensor([3.0, 0.0])  # the GRPO gradient, already reduced over the group (A + B)
    w_b.grad = torch.tensor([3.0, 0.0])
    other_rank_term = {"a": torch.tensor([0.0, 4.0]), "b": torch.tensor([0.0, 0.0])}  # the peer's g_k

    def reduce_on(rank):
        def reduce(params):
            (p,) = params
            local = p.grad if p.grad is not None else torch.zeros_like(p)
            p.grad = local + other_rank_term[rank]
        return reduce

    terms = [("sgt", 0.25, None)]  # the group's term names: rank A has none of its own
    m_a = backward_aux_losses([], None, w_a, lambda loss: loss.backward(), [w_a], tag=lambda n: n,
                              reduce=reduce_on("a"), terms=terms)
    term = _Term("sgt", lambda w: 4.0 * w[1], max_grad_share=0.25)
    m_b = backward_aux_losses([term], None, w_b, lambda loss: loss.backward(), [w_b], tag=lambda n: n,
                              totals={"sgt_demos": 3.0}, reduce=reduce_on("b"), terms=terms)
    assert w_a.grad.tolist() == pytest.approx([3.0, 1.0]) and w_b.grad.tolist() == pytest.approx([3.0, 1.0])
    for m in (m_a, m_b):
        assert m["sgt/grad_share_raw"] == pytest.approx(4 / 7) and m["sgt/grad_scale"] == pytest.approx(0.25)
    assert term.totals_seen == [{"sgt_demos": 3.0}]  # the group's totals reach the term as an argument


def test_a_huge_but_finite_transfer_gradient_is_bounded_not_dropped():
    """Entries of 1e20 overflow a float32 sum of squares; the norm is then taken in float64, so the term is
    scaled to its bound instead of getting a norm of inf and a scale of 0."""
    w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    w.grad = torch.tensor([3.0, 4.0])  # ||g_0|| = 5
    term = _Term("sgt", lambda p: 1e20 * p[0], max_grad_share=0.5)
    metrics = backward_aux_losses([term], None, w, lambda loss: loss.backward(), [w], tag=lambda n: n)
    assert metrics["sgt/grad_norm"] == pytest.approx(1e20)
    assert metrics["sgt/grad_share"] == pytest.approx(0.5)  # bounded: ||s g_k|| = ||g_0||
    assert w.grad.tolist() == pytest.approx([3.0 + 5.0, 4.0])


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_transfer_gradient_is_not_bounded_away_but_skips_the_update(bad):
    """A bound would scale an inf term by b/(1-b) r/inf = 0 and drop it unseen: it is added whole instead,
    its shares logged NaN, and the update's non-finite check skips the step."""
    from types import SimpleNamespace

    from mrl_lightning.model.numerics import skip_nonfinite_update

    w = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    w.grad = torch.tensor([3.0, 4.0])
    term = _Term("sgt", lambda p: bad * p[0], max_grad_share=0.3)
    metrics = backward_aux_losses([term], None, w, lambda loss: loss.backward(), [w], tag=lambda n: n)
    assert metrics["sgt/grad_scale"] == 1.0
    assert math.isnan(metrics["sgt/grad_share"]) and math.isnan(metrics["sgt/grad_share_raw"])
    assert not bool(torch.isfinite(w.grad).all())
    policy = SimpleNamespace(policy_name="p")
    with pytest.warns(UserWarning):
        assert skip_nonfinite_update(policy, [w]) and policy.nonfinite_updates_skipped == 1


def test_the_bounded_term_is_added_in_place_with_the_rounding_of_g0_plus_scale_times_gk():
    torch.manual_seed(0)
    lin = torch.nn.Linear(300, 200)
    params = list(lin.parameters())
    x = torch.randn(64, 300)

    class Term:
        name, max_grad_share, grad_share_floor = "sgt", 0.3, None

        def __call__(self, policy, model, totals):
            return (lin(x[:3]) ** 2).sum() * 7.3, {}

    lin(x).sin().sum().backward()
    g0 = [p.grad.clone() for p in params]
    metrics = backward_aux_losses([Term()], None, lin, lambda loss: loss.backward(), params, tag=lambda n: n)
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    Term()(None, None, None)[0].backward()
    scale = metrics["sgt/grad_scale"]
    assert 0.0 < scale < 1.0  # the bound binds
    assert all(torch.equal(a + p.grad * scale, g) for a, p, g in zip(g0, params, got))


def test_norm_bit_equal_whole_at_or_below_the_row_size_and_accurate_above_without_a_temporary(monkeypatch):
    from mrl_lightning.objectives import aux_share

    g = torch.Generator().manual_seed(3)
    small = torch.randn(1000, generator=g)
    large = torch.randn(70_001, generator=g) * 1e-3  # not a whole number of rows: the tail counts too
    whole = float(torch.stack([small.pow(2).sum(), large.pow(2).sum()]).sum().sqrt())
    monkeypatch.setattr(aux_share, "WHOLE_SUM_ELEMENTS", 70_001)  # both at or below: summed whole, as always
    assert aux_share._norm([small, large]) == whole
    monkeypatch.setattr(aux_share, "WHOLE_SUM_ELEMENTS", 4096)  # `large` above it: by rows
    exact = float(torch.cat([small, large]).double().pow(2).sum().sqrt())
    by_rows = aux_share._norm([small, large])
    assert by_rows == pytest.approx(exact, rel=1e-7)
    squared = []  # no temporary the size of `large`: nothing squares it, nothing copies it

    class Sizes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.pow, torch.pow, torch.Tensor.to, torch.Tensor.float, torch.Tensor.double):
                squared.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    with Sizes():
        assert aux_share._norm([small, large]) == by_rows
    assert max(squared) <= max(small.numel(), large.numel() // aux_share.NORM_ROW + 1)
    low = large.to(torch.bfloat16)  # a gradient in the compute dtype: float32 sums, the same path
    assert float(aux_share._squares(low, torch.float32)) == pytest.approx(float(low.double().pow(2).sum()),
                                                                           rel=1e-7)
    big = torch.randn(1 << 24, generator=g)  # 16.8 M entries: float32 rows, a float64 sum
    assert float(aux_share._squares(big, torch.float32)) == pytest.approx(float(big.double().pow(2).sum()), rel=1e-7)
    wide = large.double()  # a 64-true run's gradient: float32 chunks, as before (no narrowing norm)
    assert float(aux_share._squares(wide, torch.float32)) == pytest.approx(float(wide.pow(2).sum()), rel=1e-6)
    # a non-contiguous gradient is summed whole, and a huge finite one still gets a finite norm
    strided = torch.randn(300, 40, generator=g).t()
    assert aux_share._norm([strided]) == float(strided.pow(2).sum().sqrt())
    huge = torch.full((9000,), 1e19)
    assert aux_share._norm([huge]) == pytest.approx(float(huge[0]) * math.sqrt(9000), rel=1e-9)
    huge_rows = torch.full((9000,), 1e19)  # above the row size too: the float64 fallback in chunks
    assert aux_share._norm([huge_rows]) == pytest.approx(float(huge_rows[0]) * math.sqrt(9000), rel=1e-9)


def test_scaled_sum_is_scale_then_add_at_or_below_the_dot_size_and_one_pass_above(monkeypatch):
    from mrl_lightning.objectives import aux_share

    g = torch.Generator().manual_seed(4)
    total, term = torch.randn(50_001, generator=g), torch.randn(50_001, generator=g)
    expected = total.clone().add_(term.clone().mul_(0.37))
    out = aux_share._scaled_sum(total.clone(), term.clone(), 0.37)  # at or below WHOLE_SUM_ELEMENTS: the old rounding
    assert torch.equal(out, expected)
    assert torch.equal(aux_share._scaled_sum(total.clone(), term.clone(), 1.0), total + term)
    assert torch.equal(aux_share._scaled_sum(None, term.clone(), 0.37), term * 0.37)
    # a non-contiguous gradient takes the two-step path, with the same rounding
    t2 = torch.randn(300, 40, generator=g)
    s2 = torch.randn(40, 300, generator=g).t()
    assert torch.equal(aux_share._scaled_sum(t2.clone(), s2.clone(), 0.5), t2 + s2 * 0.5)
    monkeypatch.setattr(aux_share, "WHOLE_SUM_ELEMENTS", 4096)  # above it: one pass, within one rounding of the sum
    ops = []

    class Ops(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    into, part = total.clone(), term.clone()
    with Ops():
        fused = aux_share._scaled_sum(into, part, 0.37)
    assert [op for op in ops if not op.startswith("__") and (op.endswith("_") or op in ("mul", "add"))] == ["add_"]  # one pass, no scaled copy
    assert torch.equal(part, term)  # `term` left as it was: not scaled in place first
    torch.testing.assert_close(fused, expected, rtol=2 ** -23, atol=2 ** -23)
    assert not torch.equal(fused, total)


def test_scaled_sum_of_two_views_of_one_buffer_is_refused_as_before(monkeypatch):
    from mrl_lightning.objectives import aux_share

    monkeypatch.setattr(aux_share, "NORM_CHUNK_ELEMENTS", 16)
    buffer = torch.randn(200)
    with pytest.raises(RuntimeError):  # partly overlapping: torch refuses the in-place add, chunks or not
        aux_share._scaled_sum(buffer[:150], buffer[50:], 0.5)
