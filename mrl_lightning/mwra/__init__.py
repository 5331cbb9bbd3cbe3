"""MWRA: resource plan and scheduling of the policies' work (SPEC 6)."""

from mrl_lightning.mwra.plan import (
    PolicyPlacement,
    build_plan,
    format_plan,
    validate_plan,
)

__all__ = ["PolicyPlacement", "build_plan", "format_plan", "validate_plan"]
