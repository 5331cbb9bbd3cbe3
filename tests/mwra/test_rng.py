"""Sampling streams: keyed by (seed, policy, step), restoring every generator (CPU and CUDA)."""

from __future__ import annotations

import torch

from mrl_lightning.mwra import rng_state, sampling_rng, set_rng_state, stream_seed


def test_sampling_stream_depends_on_its_key_not_on_what_ran_before():
    with sampling_rng(stream_seed(0, "gpt2", "rollout", 3, 0)):
        a = torch.rand(4)
    torch.rand(100)  # another policy sampled in this process in between
    with sampling_rng(stream_seed(0, "gpt2", "rollout", 3, 0)):
        b = torch.rand(4)
    with sampling_rng(stream_seed(0, "llama", "rollout", 3, 0)):
        c = torch.rand(4)
    with sampling_rng(stream_seed(1, "gpt2", "rollout", 3, 0)):
        d = torch.rand(4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_sampling_stream_is_the_stream_of_torch_manual_seed():
    """The CPU generator is seeded as ``torch.manual_seed`` seeds it (runs before this change sample alike)."""
    with sampling_rng(2024):
        inside = torch.rand(5)
    torch.manual_seed(2024)
    assert torch.equal(inside, torch.rand(5))


def test_sampling_leaves_the_cpu_generator_as_it_was():
    before = torch.get_rng_state()
    with sampling_rng(123):
        torch.rand(10)
    assert torch.equal(torch.get_rng_state(), before)


def test_sampling_restores_every_cuda_device_generator(monkeypatch):
    """``torch.manual_seed`` seeds every CUDA device: each one's state must come back (faked CUDA)."""
    states = {0: torch.tensor([1], dtype=torch.uint8), 1: torch.tensor([2], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[int(str(device).split(":")[-1])].clone())

    def set_state(state, device="cuda"):
        states[int(str(device).split(":")[-1])] = state.clone()

    def seed_all(seed):  # what torch.manual_seed does to every device
        for k in states:
            states[k] = torch.tensor([99], dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seed_all)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    with sampling_rng(5):  # every device's generator is seeded inside ...
        assert states[0].item() == 99 and states[1].item() == 99
    assert states[0].item() == 1 and states[1].item() == 2  # ... and restored after


def test_rng_state_round_trips_and_reports_cuda_it_cannot_restore():
    state = rng_state()
    expected = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), expected)
    notes = set_rng_state(dict(state, cuda=[torch.zeros(8, dtype=torch.uint8)]))
    assert notes and "CUDA generator" in notes[0]
