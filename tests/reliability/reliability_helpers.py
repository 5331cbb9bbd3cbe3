"""Helpers of the hostile-input tests (imported by name: tests/ has no package)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def force_logits(model, fill, when=lambda module: True):
    """Replace the LM head's logits by ``fill(logits)`` while the block runs (when ``when(head)``)."""
    head = model.get_output_embeddings()

    def hook(module, args, output):
        return fill(output) if when(module) else output

    handle = head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
