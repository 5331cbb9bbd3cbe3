"""Fixtures for end-to-end CLI runs on tiny randomly initialized policies."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from e2e_configs import tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def write_config(tmp_path):
    """Write a tiny config (optionally modified) and return its path."""

    def _write(name: str = "tiny.yaml", modify=None, **kwargs) -> Path:
        cfg = tiny_config(tmp_path / "cache", tmp_path / "runs", **kwargs)
        if modify is not None:
            modify(cfg)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg))
        return path

    return _write
