"""Linear learning-rate warm-up of a policy's optimizer (PolicyModule ``warmup_steps``, TRL ``warmup_steps``).

Step k (0-based) uses ``learning_rate * min(1, (k + 1) / warmup_steps)``, counted from the
optimizer's own state, so a resumed optimizer continues the ramp.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.policy_update import warmup_learning_rate


def _steps(policy, optimizer, param, n):
    lrs = []
    for _ in range(n):
        param.grad = torch.ones_like(param)
        lrs.append(warmup_learning_rate(policy, optimizer))
        assert optimizer.param_groups[0]["lr"] == lrs[-1]
        optimizer.step()
    return lrs


def test_ramp_over_four_steps_then_constant():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    policy = SimpleNamespace(learning_rate=1e-3, warmup_steps=4)
    assert _steps(policy, optimizer, param, 6) == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_resumed_optimizer_continues_the_ramp():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    policy = SimpleNamespace(learning_rate=1e-3, warmup_steps=4)
    _steps(policy, optimizer, param, 2)
    state = optimizer.state_dict()
    param2 = torch.nn.Parameter(param.detach().clone())
    resumed = torch.optim.AdamW([param2], lr=1e-3)
    resumed.load_state_dict(state)
    assert _steps(policy, resumed, param2, 3) == pytest.approx([7.5e-4, 1e-3, 1e-3])


def test_no_warmup_leaves_the_learning_rate_alone():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=3e-4)
    assert warmup_learning_rate(SimpleNamespace(learning_rate=3e-4, warmup_steps=0), optimizer) == 3e-4
    assert optimizer.param_groups[0]["lr"] == 3e-4


def test_negative_warmup_is_a_config_error():
    from mrl_lightning.errors import ConfigError
    from mrl_lightning.policy import PolicyModule

    with pytest.raises(ConfigError, match="warmup_steps=-1 must be >= 0"):
        PolicyModule(name="p", model="gpt2", warmup_steps=-1)
