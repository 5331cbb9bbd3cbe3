"""The tiny two-family config the end-to-end tests run (imported by conftest and tests)."""

from __future__ import annotations

from pathlib import Path


def tiny_config(cache_dir: Path, root_dir: Path, *, callbacks: list | None = None) -> dict:
    """Two tiny policies of different families (GPT-2 / byte-level BPE, Llama / SentencePiece)."""
    parts = [
        {"name": "add", "dataset": "basic_arithmetic",
         "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                    "allow_parentheses": False, "allow_negation": False}},
        {"name": "sub", "dataset": "basic_arithmetic",
         "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["-"],
                    "allow_parentheses": False, "allow_negation": False}},
    ]

    def policy(name, family, kind, vocab, template):
        return {"class_path": "mrl_lightning.policy.PolicyModule", "init_args": {
            "name": name,
            "model": {"class_path": "mrl_lightning.recipes.TinyCausalLM", "init_args": {
                "family": family, "tokenizer_kind": kind, "vocab_size": vocab, "hidden_size": 32,
                "num_layers": 1, "num_heads": 2, "cache_dir": str(cache_dir)}},
            "prompt_template": template, "learning_rate": 1e-2, "num_generations": 4,
            "max_completion_length": 4, "temperature": 1.5, "strong_parts": ["add"] if name == "gpt2" else ["sub"],
        }}

    return {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 2, "default_root_dir": str(root_dir), "log_every_n_steps": 1,
            "eval_every_n_steps": 1000, "checkpoint_every_n_steps": 1, "enable_progress_bar": False,
            "num_threads": 1, "num_sample_completions": 2,
            "callbacks": callbacks if callbacks is not None else [
                {"class_path": "mrl_lightning.callbacks.SharedExperienceExchange"},
                {"class_path": "mrl_lightning.callbacks.SuccessGatedTransfer",
                 "init_args": {"lambda_sgt": 0.5, "kappa": 1.0}},
            ],
        },
        "model": {
            "reward_funcs": [{"class_path": "e2e_rewards.HashReward"}],
            "policies": [
                policy("gpt2", "gpt2", "byte_level_bpe", 300, "{question}\nAnswer:"),
                policy("llama", "llama", "sentencepiece_bpe", 300, "Q: {question}\nA:"),
            ],
        },
        "data": {"class_path": "mrl_lightning.data.ReasoningGymDataModule",
                 "init_args": {"batch_size": 2, "train_size": 50, "eval_size": 4, "seed": 0, "parts": parts}},
    }


def write_tiny_config(tmp_path: Path, name: str = "tiny.yaml", modify=None, **kwargs) -> Path:
    """Write :func:`tiny_config` (cache and runs under ``tmp_path``), after ``modify(cfg)``, to ``tmp_path / name``."""
    import yaml

    cfg = tiny_config(tmp_path / "cache", tmp_path / "runs", **kwargs)
    if modify is not None:
        modify(cfg)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def forbid_model_build(monkeypatch) -> None:
    """Make any model build or load raise (config errors must come before it)."""
    import transformers

    def boom(*args, **kwargs):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr("mrl_lightning.recipes.tiny.TinyCausalLM.materialize", boom)
