"""An update's passes share one cast of each weight (mrl_lightning.model.weight_casts), with the same bits.

Under bf16 autocast every forward pass casts each float32 weight; an update runs several
passes on unchanged weights (GRPO, then each auxiliary term's own pass). Inside
``shared_casts`` each weight is cast once. A checked head's model runs its own head on no
position.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mrl_lightning.model import logprobs

from mrl_lightning.model import weight_casts
from mrl_lightning.model.logprobs import completion_logprobs
from mrl_lightning.model.weight_casts import shared_casts

VOCAB = 1031


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=0, max_position_embeddings=64)
    return LlamaForCausalLM(config).train()


def _rows(seed: int, n: int = 4, p: int = 5, length: int = 6):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (n // 2, p), generator=g).repeat_interleave(2, 0)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    prompt_mask[:2, :1] = False
    completion_ids = torch.randint(3, VOCAB, (n, length), generator=g)
    completion_mask = torch.arange(length).unsqueeze(0) < torch.randint(1, length + 1, (n, 1), generator=g)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


class _Casts(TorchDispatchMode):
    """Counts float32 -> bfloat16 copies of tensors shaped like one of ``shapes``."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and isinstance(out, torch.Tensor) \
                and out.dtype == torch.bfloat16 and tuple(out.shape) in self.shapes:
            self.count += 1
        return out


def _two_passes(model, shared: bool, mode=None):
    """A GRPO-like pass, then a term's pass, each forward under its own autocast region; their gradients."""
    grads = []
    with shared_casts("cpu") if shared else contextlib.nullcontext(), mode or contextlib.nullcontext():
        for seed in (0, 1):
            model.zero_grad(set_to_none=True)
            rows = _rows(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logp, _ = completion_logprobs(model, *rows, temperature=0.7, chunk_elements=3 * VOCAB)
            (logp * rows[3]).sum().backward()  # outside the pass's autocast region, as the update's backward
            grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def test_shared_casts_give_the_same_gradients_bit_for_bit_with_one_cast_per_weight():
    model = _model()
    with torch.no_grad():  # the first call checks the head against the model's own logits (a cast of its own)
        completion_logprobs(model, *_rows(5), temperature=0.7, chunk_elements=3 * VOCAB)
    assert model.get_output_embeddings() in logprobs._CHECKED
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    fresh, shared = _Casts(shapes), _Casts(shapes)
    plain = _two_passes(model, False, fresh)
    once = _two_passes(model, True, shared)
    for a, b in zip(plain, once):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    matrices = sum(1 for p in model.parameters() if p.dim() == 2)  # 7 per layer + the tied embedding / head
    assert shared.count == matrices  # each weight once, in the first pass
    assert fresh.count > 2 * matrices  # without the context: every pass casts again (the check can fail)


def test_a_weight_changed_in_place_is_cast_again():
    weight = torch.nn.Parameter(torch.randn(8, 4))
    with shared_casts():
        first = weight_casts.low(weight, torch.bfloat16)
        assert weight_casts.low(weight, torch.bfloat16) is first
        with torch.no_grad():
            weight.add_(1.0)  # an optimizer step inside the context would do this
        again = weight_casts.low(weight, torch.bfloat16)
    assert again is not first and torch.equal(again, weight.detach().to(torch.bfloat16))
    assert weight_casts.low(weight, torch.bfloat16) is not again  # outside the context: a fresh cast each call


def test_a_checked_head_runs_on_no_position_and_gives_the_checked_log_probs():
    model = _model()
    head = model.get_output_embeddings()
    logprobs._CHECKED.discard(head)
    positions = []
    handle = head.register_forward_pre_hook(lambda module, args: positions.append(args[0].shape[-2]))
    rows = _rows(2)
    try:
        with torch.no_grad():
            first, _ = completion_logprobs(model, *rows, temperature=0.7, chunk_elements=3 * VOCAB)
            assert head in logprobs._CHECKED and sum(positions) > 0  # the first call checks against the model's
            positions.clear()
            second, _ = completion_logprobs(model, *rows, temperature=0.7, chunk_elements=3 * VOCAB)
    finally:
        handle.remove()
    assert positions and sum(positions) == 0  # the model's own head ran, on no position
    assert torch.equal(first, second)


@pytest.mark.parametrize("share", [True, False])
def test_completion_hidden_without_the_probe_gives_the_same_hidden_states(share):
    from mrl_lightning.model.forward import completion_hidden

    model = _model()
    rows = _rows(3)
    with torch.no_grad():
        hidden, probe_h, probe_z = completion_hidden(model, *rows, share_prompts=share)
        bare, none_h, none_z = completion_hidden(model, *rows, share_prompts=share, probe=False)
    assert probe_h is not None and probe_z is not None and none_h is None and none_z is None
    assert torch.equal(hidden, bare)



def test_a_short_term_pass_takes_the_math_attention_kernel_on_a_cpu_under_mixed_precision_only():
    import types

    from lightning.fabric.plugins.precision.amp import MixedPrecision

    from mrl_lightning.update.policy_update import MATH_ATTENTION_ROWS, MATH_ATTENTION_TOKENS, term_attention

    def fabric(mixed: bool):
        precision = MixedPrecision("bf16-mixed", device="cpu") if mixed else object()
        return types.SimpleNamespace(device=torch.device("cpu"), strategy=types.SimpleNamespace(precision=precision))

    def term(shape):
        return types.SimpleNamespace(pass_shape=lambda: shape)

    q = torch.randn(2, 4, 6, 8, dtype=torch.bfloat16, requires_grad=True)

    def kernel(context=None):
        with context or contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return type(out.grad_fn).__name__

    own = kernel()  # torch's own pick
    math = kernel(torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]))
    assert own != math  # the two kernels build different graphs: the check below can fail
    short, long_rows, many = (2, 45), (2, MATH_ATTENTION_TOKENS + 1), (MATH_ATTENTION_ROWS + 1, 10)
    assert kernel(term_attention(fabric(True), [term(short)])) == math
    assert kernel(term_attention(fabric(False), [term(short)])) == own  # float32: torch's own
    unknown = [term(short), term(None)], [term(short), types.SimpleNamespace()]  # no shape, or no pass_shape
    for terms in ([term(long_rows)], [term(many)], *unknown, []):  # long, many, unknown, none
        assert kernel(term_attention(fabric(True), terms)) == own


def test_sgt_builds_thl_s_tables_at_setup_not_in_the_first_transfer():
    import types
    from pathlib import Path

    from transformers import AutoTokenizer

    from mrl_lightning.callbacks import SuccessGatedTransfer
    import importlib

    thl_retokenize = importlib.import_module("mrl_lightning.thl.retokenize")

    tokenizer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "models" / "default" / "gpt2"))
    assert getattr(tokenizer, thl_retokenize._STATE_ATTR, None) is None
    producer = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "models" / "default" / "llama"))
    system = types.SimpleNamespace(policies={"a": types.SimpleNamespace(tokenizer=tokenizer),
                                             "b": types.SimpleNamespace(tokenizer=producer)})
    workers = types.SimpleNamespace(local_policies=["a"])  # this rank updates "a" only
    SuccessGatedTransfer().setup(types.SimpleNamespace(workers=workers), system, None)
    assert getattr(tokenizer, thl_retokenize._STATE_ATTR, None) is not None  # a receiver here: its encoder
    assert getattr(producer, thl_retokenize._STATE_ATTR, None) is None  # a producer only: its byte table
    assert getattr(producer, thl_retokenize._TABLE_ATTR, None) is not None
