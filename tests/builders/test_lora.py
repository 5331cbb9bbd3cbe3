"""LoRA policies (peft) and gradient checkpointing (docs/mwra.md, "Memory per policy").

Tiny Llama / GPT-2 models built from config, saved, and loaded back through the real
``from_pretrained`` path, as a user's model folder is.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrl_lightning.update.batch import TrainBatch
from mrl_lightning.builders import build_policy, plan_shapes
from mrl_lightning.errors import ConfigError
from mrl_lightning.objectives.grpo import group_advantages
from mrl_lightning.policy import PolicyModule
from mrl_lightning.update.policy_update import policy_update

pytest.importorskip("peft")

CORPUS = ["Calculate 12 + 34.\nAnswer: 46", "What is 7 - 5?\nAnswer: 2"]
FABRIC = SimpleNamespace(backward=lambda loss: loss.backward(), clip_gradients=None)


def _folder(tmp_path_factory, family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from mrl_lightning.recipes.tokenizers import train_char_level

    folder = tmp_path_factory.mktemp(f"lora_{family}")
    tok = train_char_level(CORPUS, folder)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                             max_position_embeddings=64, initializer_range=0.2, **ids))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           initializer_range=0.2, **ids))
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _folder(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return _folder(tmp_path_factory, "gpt2")


def _policy(folder, **kwargs) -> PolicyModule:
    args = dict(name="p", model=str(folder), num_generations=4, max_completion_length=4, temperature=0.8,
                max_grad_norm=None, learning_rate=0.05)
    args.update(kwargs)
    policy = PolicyModule(**args)
    build_policy(policy)
    return policy


def _batch(policy, beta_rewards=((1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 1.0, 1.0))):
    from mrl_lightning.rollout.hf_generate import HFGenerateEngine

    prompts = policy.encode_prompts(["12 + 34?", "7 - 5?"])
    out = HFGenerateEngine().generate(policy.model, policy.tokenizer, prompts, num_generations=4,
                                      max_completion_length=4, temperature=0.8, prompt_seeds=[1, 2])
    rewards = torch.tensor(beta_rewards)
    return TrainBatch(SimpleNamespace(rollouts=out), group_advantages(rewards, "group"))


def test_only_the_adapter_trains_and_the_checkpoint_holds_only_it(llama_dir):
    policy = _policy(llama_dir, use_peft=True, lora_r=4, lora_alpha=8.0)
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # peft's default targets for Llama are q_proj and v_proj: 2 layers x 2 modules x r (32 + 32)
    assert sum(p.numel() for p in policy.model.parameters() if p.requires_grad) == 2 * 2 * 4 * (32 + 32)
    optimizer = policy.configure_optimizers()
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == 2 * 2 * 4 * 64
    state = {k: v.clone() for k, v in policy.weights_state_dict().items()}  # the live tensors otherwise
    assert state and all("lora_" in k for k in state) and not any("embed_tokens" in k for k in state)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    policy_update(policy, _batch(policy), policy.model, FABRIC, optimizer)
    assert all(torch.equal(base[n], p) for n, p in policy.model.named_parameters() if not p.requires_grad)
    moved = policy.weights_state_dict()
    assert any(not torch.equal(moved[k], state[k]) for k in state)

    other = _policy(llama_dir, use_peft=True, lora_r=4, lora_alpha=8.0)
    other.load_weights_state_dict({k: v.clone() for k, v in moved.items()})
    assert all(torch.equal(other.weights_state_dict()[k], v) for k, v in moved.items())
    with pytest.raises(RuntimeError, match="missing"):
        other.load_weights_state_dict({k: v for k, v in list(moved.items())[1:]})
    wrong_rank = _policy(llama_dir, use_peft=True, lora_r=2)
    with pytest.raises(RuntimeError, match="size mismatch"):
        wrong_rank.load_weights_state_dict(moved)


def test_the_reference_is_the_base_with_the_adapter_off(llama_dir):
    from transformers import AutoModelForCausalLM

    policy = _policy(llama_dir, use_peft=True, lora_r=4, beta=0.1)
    assert policy.ref_model is None  # no second copy of the model
    batch = _batch(policy)
    optimizer = policy.configure_optimizers()
    first = policy_update(policy, batch, policy.model, FABRIC, optimizer)
    assert first["train/p/kl_nats"] == pytest.approx(0.0, abs=1e-7)  # lora_B starts at 0: policy == base
    policy_update(policy, batch, policy.model, FABRIC, optimizer)
    r = batch.scored.rollouts
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected, _ = policy.completion_logprobs(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                                 model=base)
        with policy.model.disable_adapter():
            got, _ = policy.completion_logprobs(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        moved, _ = policy.completion_logprobs(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (moved - expected).abs().max() > 1e-3  # the adapter did move the policy away from it


def test_the_plan_counts_the_adapter_and_names_missing_target_modules(gpt2_dir):
    good = PolicyModule(name="g", model=str(gpt2_dir), use_peft=True, lora_r=4, lora_target_modules=["c_attn"])
    shapes, errors = plan_shapes({"g": good})
    assert errors == []
    assert shapes["g"].trainable == 2 * 4 * (32 + 96)  # c_attn: 32 -> 96, 2 layers
    bad = PolicyModule(name="b", model=str(gpt2_dir), use_peft=True, lora_target_modules=["q_proj"])
    _, errors = plan_shapes({"b": bad})
    assert len(errors) == 1 and "lora_target_modules=['q_proj']" in errors[0] and "c_attn" in errors[0]


def test_the_memory_estimate_counts_only_trainable_moments_and_checkpointed_layers():
    from mrl_lightning.mwra.plan import ModelShape, memory_options, policy_memory_terms

    shape = ModelShape("llama", params=1_000_000, vocab=100, hidden=64, layers=4, heads=4)
    full = SimpleNamespace(num_generations=2, micro_batch_size=None, max_prompt_length=8, max_completion_length=8,
                           beta=0.1, use_peft=False, gradient_checkpointing=False, lora_r=16)
    lora = SimpleNamespace(**{**vars(full), "use_peft": True})
    ckpt = SimpleNamespace(**{**vars(full), "gradient_checkpointing": True})
    adapter = ModelShape(**{**vars(shape), "trainable": 10_000})
    # full: 16 bytes a parameter + a 4-byte reference; LoRA: 4 bytes a frozen weight, 12 a trainable one, no reference
    assert policy_memory_terms(shape, full, 1)["states"] == 16_000_000 + 4_000_000
    assert policy_memory_terms(adapter, lora, 1)["states"] == 4_000_000 + 12 * 10_000
    # a layer keeps 4 * (9h + 5q + 4kv + 4i) = 4 * (9 + 5 + 4 + 16) * 64 = 8704 bytes a token (mwra/memory.py)
    logits, head = 5 * 4 * 2 * 9 * 100, 4 * 100 * 64  # five float32 copies of [2, L + 1, V]; the head's gradient
    # the prompt once (8 tokens), both completions (16), the prompt's keys and values gathered to both rows
    layer = (8 + 16) * 8704 + 2 * 16 * 2 * 64 * 4
    assert policy_memory_terms(shape, full, 1)["activations"] == 4 * layer + logits + head == 962_720
    # checkpointed: every row over prompt + completion (32 tokens); each layer's input kept, one layer's whole
    assert policy_memory_terms(shape, ckpt, 1)["activations"] == 4 * 32 * 4 * 64 + 32 * 8704 + logits + head
    assert policy_memory_terms(adapter, lora, 1)["activations"] == 4 * layer + logits  # LoRA: a frozen head
    assert memory_options(lora, adapter) == "LoRA r=16 (0.01M trainable)" and memory_options(full, shape) == "full"
    assert memory_options(ckpt, shape) == "grad. ckpt"


def test_vllm_receives_the_merged_weights_under_the_base_names(llama_dir):
    from mrl_lightning.rollout.vllm_engine import pushable_parameters

    policy = _policy(llama_dir, use_peft=True, lora_r=4, lora_alpha=8.0)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)  # a trained adapter (lora_B starts at 0)
    layer = policy.model.base_model.model.model.layers[0].self_attn.q_proj
    w, a, b = layer.base_layer.weight.detach().clone(), layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = w + (8.0 / 4) * (b @ a)  # W + alpha / r * B A
    with pytest.raises(KeyError):
        dict(policy.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    with pushable_parameters(policy.model) as params:
        pushed = dict(params)
        torch.testing.assert_close(pushed["model.layers.0.self_attn.q_proj.weight"], expected)
        assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model") for n in pushed)
        assert set(pushed) == {n for n, _ in
                               __import__("transformers").AutoModelForCausalLM.from_pretrained(str(llama_dir))
                               .named_parameters()}
    assert torch.equal(layer.base_layer.weight, w)  # the frozen base is never touched


def test_gradient_checkpointing_gives_the_same_update(gpt2_dir):
    plain, ckpt = _policy(gpt2_dir), _policy(gpt2_dir, gradient_checkpointing=True)
    assert ckpt.model.is_gradient_checkpointing
    batch = _batch(plain)
    for policy in (plain, ckpt):
        policy_update(policy, batch, policy.model, FABRIC, torch.optim.SGD(policy.model.parameters(), lr=0.1))
    for (name, a), b in zip(plain.model.named_parameters(), ckpt.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("field, value, message", [("lora_r", 0, "lora_r=0 must be >= 1"),
                                                     ("lora_alpha", 0.0, "lora_alpha=0.0 must be > 0"),
                                                     ("lora_dropout", 1.0, "lora_dropout=1.0 must be in")])
def test_bad_lora_options_are_named_before_the_build(gpt2_dir, field, value, message):
    with pytest.raises(ConfigError, match=message):
        PolicyModule(name="p", model=str(gpt2_dir), use_peft=True, **{field: value})
