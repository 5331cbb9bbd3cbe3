"""Fixtures for end-to-end CLI runs on tiny randomly initialized policies."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e_configs import write_tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def write_config(tmp_path):
    """Write a tiny config (optionally modified) and return its path."""

    def _write(name: str = "tiny.yaml", modify=None, **kwargs) -> Path:
        return write_tiny_config(tmp_path, name, modify, **kwargs)

    return _write
