"""Does ``max_prompt_length`` keep the data's questions apart? Checked on the data's own prompts.

:func:`~mrl_lightning.policy.checks.prompt_collision_errors` renders two fixed probe questions;
their last tokens differ (one ends in ``?``, the other in ``.``), so a ``max_prompt_length`` of 2
passed it while every prompt of an arithmetic task (``Calculate 53 + 4.\\nA:``) was cut to the
same ``.\\nA:`` and the model never saw a question (docs/reliability.md, row 64).
:func:`data_prompt_errors` renders every distinct question of the data (evaluation and
training items) with the policy's template and truncation and refuses a ``max_prompt_length``
under which two different questions give the same prompt ids. A cut that keeps the questions
apart is still allowed (row 15: cut from the left, counted, warned once).

:func:`check_tokenizer` is where the tokenizer comes from before any model is built: the
policy's own (a folder or hub id, loaded at construction) or, for a recipe, the folder an
earlier run built (a cache hit) or its ``prebuilt`` folder; None when the recipe has not made
it yet (it is then checked once the recipe has built it, :func:`mrl_lightning.builders.build_policy`).
"""

from __future__ import annotations

from pathlib import Path

from mrl_lightning.model.chat import encode_rendered
from mrl_lightning.model.source import ModelRecipe


def check_tokenizer(policy, datamodule):
    """``policy``'s tokenizer if it can be had without building a model, else None."""
    if policy.tokenizer is not None:
        return policy.tokenizer
    source = policy.model_source
    if not isinstance(source, ModelRecipe) or policy.tokenizer_source:
        return None
    folder = source.built_folder(policy, datamodule)
    prebuilt = getattr(source, "_prebuilt_folder", None)
    if folder is None and prebuilt is not None:
        folder = prebuilt(policy, datamodule, lambda _line: None)
    if folder is None or not Path(folder, "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # noqa: BLE001 - the build loads it again and reports what is wrong
        return None
    if policy.pad_token is not None:
        tok.pad_token = policy.pad_token
    return tok


def _questions(datamodule) -> list:
    """One item per distinct question of the data's evaluation and training prompts (set up here)."""
    datamodule.setup("fit")
    seen, items = set(), []
    for split in (datamodule.eval_items(), {p.name: datamodule.train_items(p.name) for p in datamodule.parts}):
        for part_items in split.values():
            for item in part_items:
                if item.question not in seen:
                    seen.add(item.question)
                    items.append(item)
    return items


def data_prompt_errors(policy, datamodule, tokenizer=None) -> list[str]:
    """One error when ``policy.max_prompt_length`` cuts two different questions of the data to the same prompt ids.

    Args:
        policy: A :class:`~mrl_lightning.policy.PolicyModule` (no model needed).
        datamodule: The prompt data module (set up here if it is not yet).
        tokenizer: The tokenizer to encode with (default: the policy's).

    Returns:
        Empty, or one line naming the policy, ``max_prompt_length``, two questions that collide, the longest
        prompt's token count and the fix.
    """
    tok = tokenizer if tokenizer is not None else policy.tokenizer
    if tok is None or not hasattr(datamodule, "eval_items"):
        return []
    items = _questions(datamodule)
    if not items:
        return []
    limit = policy.max_prompt_length
    previous, policy.tokenizer = policy.tokenizer, tok  # render_prompt reads a chat template from it
    try:
        texts = [policy.render_prompt(item) for item in items]
    finally:
        policy.tokenizer = previous
    if policy.chat_template:
        lengths: list[int] = []
        cut = encode_rendered(tok, texts, limit, full_lengths=lengths)
    else:
        full = tok(texts)["input_ids"]
        lengths, cut = [len(x) for x in full], [x[-limit:] for x in full]
    longest = max(lengths)
    policy._data_prompt_tokens = min(longest, limit)  # the cost model's prompt length (docs/mwra.md)
    if longest <= limit:
        return []
    first: dict[tuple, int] = {}
    clash, merged = None, 0
    for i, ids in enumerate(cut):
        j = first.setdefault(tuple(ids), i)
        if j != i:
            merged += 1
            clash = clash or (j, i)
    if clash is None:
        return []
    a, b = clash
    return [f"policy {policy.policy_name!r}: max_prompt_length={limit} cuts the data's prompts (the longest is "
            f"{longest} tokens) so that different questions become one prompt: {items[a].question[:60]!r} and "
            f"{items[b].question[:60]!r} both read {tok.decode(cut[a])!r} ({merged} of the {len(items)} distinct "
            f"questions lost); the model would not see the question. Set max_prompt_length: {longest} (or more)."]


def prompt_errors(policies: dict, datamodule) -> list[str]:
    """:func:`data_prompt_errors` of every policy whose tokenizer exists before the build (:func:`check_tokenizer`);
    each checked one is marked so that the build does not check it again."""
    errors, held = [], []
    say = getattr(type(datamodule), "log_eval_questions", None)
    if say is not None:  # the data's own line said after the check, not ahead of its error
        datamodule.log_eval_questions = lambda: held.append(True)
    try:
        for policy in policies.values():
            tok = check_tokenizer(policy, datamodule)
            if tok is not None:
                errors += data_prompt_errors(policy, datamodule, tok)
                policy._data_prompts_checked = True
    finally:
        if say is not None:
            del datamodule.log_eval_questions
    if held and not errors:
        say(datamodule)
    return errors
