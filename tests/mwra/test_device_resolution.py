"""One GPU out of the box: ``trainer.devices`` fitted to the devices present (docs/mwra.md, "One GPU").

Pure decisions (:func:`resolve_devices`) and the trainer's use of them on a machine that reports one
CUDA GPU (torch's and Lightning's device counts monkeypatched: no GPU needed).
"""

from __future__ import annotations

import pytest

from mrl_lightning.errors import ConfigError
from mrl_lightning.mwra import DeviceSettings, build_placement, devices_present, resolve_devices

ONE_GPU = {"cuda": 1, "mps": 0}
NO_GPU = {"cuda": 0, "mps": 0}


@pytest.mark.parametrize("accelerator, devices, placement, present, want_devices, want_placement, note", [
    # the shipped configs given --trainer.accelerator cuda on one GPU
    ("cuda", 2, "auto", ONE_GPU, 1, "colocated", "asked 2, found 1 cuda device(s), ran colocated"),  # default
    ("cuda", 2, "colocated", ONE_GPU, 1, "colocated", "asked 2, found 1 cuda device(s), ran colocated"),  # fsdp
    ("cuda", 1, "auto", ONE_GPU, 1, "auto", ""),  # three_families, gsm8k_math_qwen_llama
    # the CPU configs on a GPU machine: accelerator auto is the GPU
    ("auto", 2, "auto", ONE_GPU, 1, "colocated", "asked 2, found 1 cuda device(s), ran colocated"),
    ("gpu", 2, "auto", ONE_GPU, 1, "colocated", "found 1 cuda"),
    # enough devices, or the CPU: unchanged
    ("cuda", 2, "auto", {"cuda": 2}, 2, "auto", ""),
    ("auto", 2, "auto", NO_GPU, 2, "auto", ""),
    ("cpu", 2, "auto", ONE_GPU, 2, "auto", ""),
    ("cpu", 8, "disjoint", ONE_GPU, 8, "disjoint", ""),
    # several GPUs, fewer than asked: lowered, the placement left to build_placement
    ("cuda", 8, "auto", {"cuda": 2}, 2, "auto", "asked 8, found 2 cuda device(s), placement auto"),
    ("cuda", 8, "colocated", {"cuda": 4}, 4, "colocated", "ran colocated"),
    ("auto", 2, "auto", {"cuda": 0, "mps": 1}, 1, "colocated", "found 1 mps"),
])
def test_devices_are_fitted_to_the_node(accelerator, devices, placement, present, want_devices, want_placement, note):
    got = resolve_devices(accelerator, devices, placement, "auto", present)
    assert isinstance(got, DeviceSettings), got
    assert (got.devices, got.placement, got.strategy, got.accelerator) == (want_devices, want_placement, "auto",
                                                                           accelerator)
    assert (note in got.note) if note else got.note == ""


@pytest.mark.parametrize("kwargs, flags", [
    (dict(accelerator="cuda", devices=8, placement="disjoint", policy_ranks={"qwen": 4, "llama": 4}),
     "--trainer.devices 1 --trainer.placement colocated --trainer.policy_ranks null"),  # gpu_8x
    (dict(accelerator="cuda", devices=2, placement="disjoint"), "--trainer.devices 1 --trainer.placement colocated"),
    (dict(accelerator="cuda", devices=2, placement="auto", policy_ranks={"a": 1, "b": 1}),
     "--trainer.policy_ranks null"),
    (dict(accelerator="cuda", devices=2, placement="auto", num_nodes=2), "--trainer.devices 1 on every node"),
])
def test_a_placement_that_needs_the_devices_is_refused_in_one_line_naming_the_flags(kwargs, flags):
    kwargs = {"strategy": "ddp", "present": ONE_GPU, **kwargs}
    got = resolve_devices(**kwargs)
    assert isinstance(got, str) and "\n" not in got and flags in got, got
    assert "trainer.devices=" in got and "1 cuda device" in got


def test_cuda_asked_with_no_gpu_names_the_cpu_flag():
    got = resolve_devices("cuda", 1, "auto", "auto", NO_GPU)
    assert isinstance(got, str) and "--trainer.accelerator cpu" in got


def test_the_strategy_is_kept_and_the_lowered_placement_builds():
    got = resolve_devices("cuda", 2, "auto", "ddp", ONE_GPU)
    assert got.strategy == "ddp"
    assert build_placement(got.placement, None, ["gpt2", "llama"], got.devices).mode == "colocated"


@pytest.fixture
def one_gpu(monkeypatch):
    """torch and Lightning both report one CUDA GPU (nothing touches it: the trainer builds no model here)."""
    import torch
    from lightning.fabric.accelerators import cuda as lightning_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(lightning_cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(lightning_cuda, "_check_cuda_matmul_precision", lambda device: None, raising=False)


def test_devices_present_reads_torch(one_gpu):
    assert devices_present()["cuda"] == 1


def test_trainer_on_one_gpu_runs_the_default_colocated_on_one_device(one_gpu, tmp_path):
    """``mrl fit --config configs/default.yaml --trainer.accelerator cuda`` on one GPU: one device, colocated."""
    from mrl_lightning.loop.trainer import MRLTrainer

    trainer = MRLTrainer(accelerator="cuda", devices=2, placement="auto", default_root_dir=str(tmp_path),
                         enable_progress_bar=False)
    assert trainer.devices_per_node == 1 and trainer.placement_mode == "colocated"
    assert trainer.fabric.world_size == 1 and trainer.fabric.device.type == "cuda"
    assert trainer.devices_note == "trainer.devices: asked 2, found 1 cuda device(s), ran colocated."


def test_trainer_on_one_gpu_refuses_the_8_gpu_placement_in_one_line(one_gpu, tmp_path):
    from mrl_lightning.loop.trainer import MRLTrainer

    with pytest.raises(ConfigError) as info:
        MRLTrainer(accelerator="cuda", devices=8, placement="disjoint", policy_ranks={"qwen": 4, "llama": 4},
                   default_root_dir=str(tmp_path))
    assert "\n" not in str(info.value) and "--trainer.placement colocated" in str(info.value)


def test_trainer_on_the_cpu_is_unchanged(tmp_path):
    from mrl_lightning.loop.trainer import MRLTrainer

    trainer = MRLTrainer(accelerator="cpu", devices=1, placement="auto", default_root_dir=str(tmp_path))
    assert (trainer.devices_per_node, trainer.placement_mode, trainer.devices_note) == (1, "auto", "")
