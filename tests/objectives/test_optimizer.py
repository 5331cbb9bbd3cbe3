"""The policy's AdamW runs torch's multi-tensor (foreach) path on every device, with the
per-tensor loop's arithmetic: the weights after many steps are bit-for-bit the same. With
``fused_optimizer`` it is torch's fused kernel: the same steps up to float rounding."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import warmup_learning_rate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 50))
    model[1].bias.requires_grad_(False)  # a frozen parameter stays out of the optimizer
    return model


def test_policy_adamw_is_foreach_and_bit_identical_to_the_per_tensor_loop():
    ours_model, loop_model = _model(), _model()
    policy = SimpleNamespace(model=ours_model, learning_rate=3e-3, weight_decay=0.1, warmup_steps=5,
                             fused_optimizer=False)
    ours = PolicyModule.configure_optimizers(policy)
    assert ours.defaults["foreach"] is True
    assert sum(len(g["params"]) for g in ours.param_groups) == 4  # the frozen bias left out
    loop = torch.optim.AdamW([p for p in loop_model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1,
                             foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        ids = torch.randint(0, 50, (8, 6), generator=g)
        for model, opt in ((ours_model, ours), (loop_model, loop)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten()).backward()
            warmup_learning_rate(SimpleNamespace(learning_rate=3e-3, warmup_steps=5), opt)
            opt.step()
    changed = [not torch.equal(a, b) for a, b in zip(ours_model.parameters(), _model().parameters()) if a.requires_grad]
    assert all(changed), "the optimizer did not move every trainable parameter"
    for a, b in zip(ours_model.parameters(), loop_model.parameters()):
        assert torch.equal(a, b), "foreach AdamW drifted from the per-tensor loop"


def test_fused_optimizer_takes_torchs_fused_kernel_with_the_same_steps_up_to_rounding():
    fused_model, foreach_model = _model(), _model()
    fused = PolicyModule.configure_optimizers(SimpleNamespace(model=fused_model, learning_rate=3e-3, weight_decay=0.1,
                                                              fused_optimizer=True))
    foreach = PolicyModule.configure_optimizers(SimpleNamespace(model=foreach_model, learning_rate=3e-3,
                                                                weight_decay=0.1, fused_optimizer=False))
    assert fused.defaults["fused"] is True and not foreach.defaults.get("fused")
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        ids = torch.randint(0, 50, (8, 6), generator=g)
        for model, opt in ((fused_model, fused), (foreach_model, foreach)):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten()).backward()
            opt.step()
    moved = max(float((a - b).abs().max()) for a, b in zip(foreach_model.parameters(), _model().parameters()))
    for a, b in zip(fused_model.parameters(), foreach_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * moved)  # 30 steps of 3e-3 moved weights by ~0.09
