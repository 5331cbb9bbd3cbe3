"""MWRA resource plan: which device, strategy and memory each policy gets (SPEC 6).

Built after the policies are loaded and before step 1, printed as a table, and
validated: on an accelerator with a known memory size, a plan whose estimate exceeds
it stops with a clear error instead of failing mid-run. The estimate counts fp32
weights, gradients and AdamW's two moments (16 bytes per trainable parameter) plus a
frozen reference model (4 bytes per parameter) when beta > 0; activations are not
counted (they depend on batch and length), so treat it as a lower bound.

Scheduling today is sequential phases: every policy samples, then every policy
updates, in list order, on one Fabric; ``trainer.num_threads`` is the CPU thread
budget. Multi-device and multi-node runs go through Fabric's strategies and
launchers (``--trainer.strategy ddp``, torchrun / SLURM), not a home-made transport.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrl_lightning.errors import ConfigError


@dataclass
class PolicyPlacement:
    """One row of the plan.

    Attributes:
        policy: Policy name.
        family: ``config.model_type`` of its model.
        params: Trainable parameters.
        vocab: Tokenizer size.
        device: Fabric device string.
        strategy: Fabric strategy name.
        precision: Fabric precision.
        memory_gib: Estimated training memory in GiB (lower bound, see module doc).
    """

    policy: str
    family: str
    params: int
    vocab: int
    device: str
    strategy: str
    precision: str
    memory_gib: float


def build_plan(system, fabric, precision: str) -> list[PolicyPlacement]:
    """One :class:`PolicyPlacement` per policy (policies must be built; ``precision`` as given to Fabric)."""
    rows = []
    for name, policy in system.policies.items():
        trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in policy.model.parameters())
        ref = total * 4 if policy.beta > 0 else 0
        rows.append(PolicyPlacement(
            policy=name, family=getattr(policy.model.config, "model_type", "?"), params=trainable,
            vocab=len(policy.tokenizer), device=str(fabric.device), strategy=type(fabric.strategy).__name__,
            precision=precision,
            memory_gib=(trainable * 16 + ref) / 2**30,
        ))
    return rows


def validate_plan(rows: list[PolicyPlacement], device: torch.device) -> None:
    """Stop when the policies' estimated memory exceeds the accelerator's.

    Raises:
        ConfigError: the estimate is over the device's total memory.
    """
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    need = sum(r.memory_gib for r in rows)
    if need > total:
        raise ConfigError(
            f"MWRA: the policies need at least {need:.1f} GiB ({', '.join(f'{r.policy}={r.memory_gib:.1f}' for r in rows)}) "
            f"but {device} has {total:.1f} GiB. Use more devices (--trainer.devices, --trainer.strategy fsdp), "
            "lower precision, or smaller models."
        )


def format_plan(rows: list[PolicyPlacement]) -> str:
    """The plan as a plain-text table."""
    header = ("policy", "family", "params", "vocab", "device", "strategy", "precision", "mem GiB (min)")
    body = [(r.policy, r.family, f"{r.params / 1e6:.2f}M", str(r.vocab), r.device, r.strategy, r.precision,
             f"{r.memory_gib:.3f}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body])
