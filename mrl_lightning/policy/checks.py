"""Config checks of a policy that need more than its own fields: sources, tokenizer, templates, prompts.

Run at construction (:meth:`~mrl_lightning.policy.PolicyModule.config_errors`), before
any model is built, and for a recipe's tokenizer once the recipe has made it:

- :func:`source_errors`: a ``model`` / ``tokenizer`` folder that does not exist, a hub id
  that cannot be reached offline (:mod:`mrl_lightning.model.hub`), a tokenizer that
  :func:`tokenizer_errors` rejects (no EOS, no pad token, a missing chat template);
- :func:`template_errors`: a ``str.format`` template without its one field;
- :func:`position_errors`: ``max_prompt_length + max_completion_length`` beyond the positions
  of the model a recipe builds.

Two things can make a policy unable to see its question, and neither raises on its own:

- a template that renders the same prompt for different questions: a chat template that
  drops the user turn, or a ``max_prompt_length`` so small that left truncation keeps only
  the template's end, the same for every question. :func:`prompt_collision_errors`
  renders two unlike questions with the policy's own template, chat template and
  truncation and reports a config error when the token ids come out equal.
- a prompt longer than ``max_prompt_length``: its ids are cut from the left (the start of
  the question is lost, the template's end kept, as TRL truncates). :func:`note_prompt_lengths`
  counts such prompts (``rollout/<policy>/prompts_truncated_share`` per step, and
  ``prompts_truncated`` on the policy in all) and warns once per policy.
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

from mrl_lightning.model.chat import chat_template_errors
from mrl_lightning.model.hub import HubUnreachableError, hub_load_kwargs
from mrl_lightning.model.source import ModelRecipe, looks_local, tokenizer_files_problem
from mrl_lightning.policy.grpo_checks import grpo_option_errors

PROBE_QUESTIONS = ("What is 12 + 7?", "Name the capital of France, in one word.")


def prompt_collision_errors(policy) -> list[str]:
    """Config errors when two unlike questions give the same prompt ids under ``policy``.

    Args:
        policy: A :class:`~mrl_lightning.policy.PolicyModule` whose ``tokenizer`` is set.

    Returns:
        Error messages naming the field, the value and the fix (empty when prompts differ).
    """
    p = f"policy {policy.policy_name!r}"
    texts = [policy.render_prompt(SimpleNamespace(question=q)) for q in PROBE_QUESTIONS]
    if texts[0] == texts[1]:
        where = ("its tokenizer's chat template (chat_template: true)" if getattr(policy, "chat_template", False)
                 else f"prompt_template={policy.prompt_template!r}")
        return [f"{p}: {where} renders the same prompt {texts[0][:120]!r} for the questions {PROBE_QUESTIONS[0]!r} "
                f"and {PROBE_QUESTIONS[1]!r}: the question never reaches the model. Use a template that places "
                "the question (a chat template must render the user message)."]
    ids = policy.encode_prompts(texts)
    if ids[0] == ids[1]:
        tail = policy.tokenizer.decode(ids[0])
        full = len(policy.tokenizer(texts[0], add_special_tokens=False)["input_ids"])
        return [f"{p}: max_prompt_length={policy.max_prompt_length} cuts every prompt to its last "
                f"{len(ids[0])} tokens, {tail!r}, which are the same for every question (a rendered question here "
                f"is {full} tokens). Raise max_prompt_length above the template's own length."]
    return []


def note_prompt_lengths(policy, lengths: list[int]) -> None:
    """Count the prompts longer than ``max_prompt_length`` (they are cut) and warn once per policy.

    Counts only prompts sent to a built model (rollouts and evaluation), not the config
    check's probe prompts.

    Args:
        policy: The policy encoding the prompts.
        lengths: Token counts of the prompts before truncation.
    """
    if policy.model is None or not lengths:
        return
    over = [n for n in lengths if n > policy.max_prompt_length]
    policy.prompts_truncated = getattr(policy, "prompts_truncated", 0) + len(over)
    policy.last_prompts_truncated_share = len(over) / len(lengths)
    if over and not getattr(policy, "_warned_prompt_truncation", False):
        policy._warned_prompt_truncation = True
        name = policy.policy_name
        warnings.warn(f"policy {name!r}: a prompt of {max(over)} tokens is longer than max_prompt_length="
                      f"{policy.max_prompt_length}; its ids are cut from the left (the start of the question is "
                      f"lost). Counted in rollout/{name}/prompts_truncated_share; warned once. Raise "
                      "max_prompt_length to keep whole prompts.", stacklevel=3)


def option_errors(policy) -> list[str]:
    """Problems of a policy's own values that need neither a model nor a tokenizer.

    The GRPO and sampling options (:func:`grpo_option_errors`), the rollout engine's
    (:func:`mrl_lightning.rollout.options.engine_config_errors`), LoRA / FSDP
    (:func:`memory_option_errors`), the chat options and the templates. ``policy`` is a
    :class:`~mrl_lightning.policy.PolicyModule` or anything with its attributes: ``mrl fit``
    runs this on the values read from the arguments before the config is parsed
    (:func:`mrl_lightning.config.preflight.quick_policy_errors`).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    from mrl_lightning.rollout.options import engine_config_errors

    p = f"policy {policy.policy_name!r}"
    errors = grpo_option_errors(p, policy)
    errors.extend(engine_config_errors(p, policy))
    errors.extend(memory_option_errors(p, policy))
    if policy.system_prompt is not None and not policy.chat_template:
        errors.append(f"{p}: system_prompt={policy.system_prompt!r} needs chat_template: true (a system turn "
                      "exists only in a chat format); set chat_template: true, or drop system_prompt and "
                      "write the instruction into prompt_template.")
    errors.extend(stop_errors(p, getattr(policy, "stop", None)))
    for key, template, field in (("prompt_template", policy.prompt_template, "question"),
                                 ("completion_template", policy.completion_template, "answer")):
        errors.extend(template_errors(p, key, template, field))
    return errors


def stop_errors(where: str, stop) -> list[str]:
    """Problems of a policy's ``stop`` strings: each must be a non-empty string (vLLM refuses an empty one).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) and x for x in items):
        return [f"{where}: stop={stop!r} must be a list of non-empty strings (e.g. stop: [\"\\n\"]) or null; an empty "
                "string would end every completion at once (vLLM refuses it too)."]
    return []


def template_errors(where: str, key: str, template: str, field: str) -> list[str]:
    """Problems of a ``str.format`` template that must use exactly the field ``{field}``."""
    try:
        rendered = template.format(**{field: "\x00"})
    except (KeyError, IndexError) as exc:
        return [f"{where}: {key}={template!r} uses the unknown field {exc}; only {{{field}}} is available "
                "(write literal braces as '{{' and '}}')."]
    except ValueError as exc:
        return [f"{where}: {key}={template!r} is not a valid template ({exc}); "
                "write literal braces as '{{' and '}}'."]
    if "\x00" not in rendered:
        return [f"{where}: {key}={template!r} must contain '{{{field}}}'."]
    return []


def source_errors(policy) -> list[str]:
    """Problems of ``policy``'s ``model`` / ``tokenizer`` sources: a local folder that does not exist, a hub id
    unreachable offline, a tokenizer that fails :func:`tokenizer_errors` (which then loads it).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    p = f"policy {policy.policy_name!r}"
    errors: list[str] = []
    if isinstance(policy.model_source, ModelRecipe):  # a missing package or file (e.g. a GGUF source's)
        errors.extend(policy.model_source.source_errors(p))
    if isinstance(policy.model_source, str) and looks_local(policy.model_source):
        if not Path(policy.model_source).expanduser().is_dir():
            errors.append(f"{p}: model={policy.model_source!r} is not an existing folder. Give a folder "
                          "written by save_pretrained, a hub id, or a recipe (class_path).")
    tok = policy.tokenizer_source
    if tok is None and isinstance(policy.model_source, str):
        tok = policy.model_source
    elif isinstance(policy.model_source, str) and not looks_local(policy.model_source):
        try:  # the tokenizer comes from elsewhere: the model's hub id is checked on its own
            hub_load_kwargs(policy.model_source, "model", p)
        except HubUnreachableError as exc:
            errors.append(str(exc))
    if isinstance(tok, str):
        if looks_local(tok) and not Path(tok).expanduser().is_dir():
            errors.append(f"{p}: tokenizer={tok!r} is not an existing folder. Give a folder written "
                          "by save_pretrained or a hub id.")
        else:
            errors.extend(tokenizer_errors(policy, tok))
    return errors


def tokenizer_errors(policy, source: str) -> list[str]:
    """Load ``policy``'s tokenizer from ``source`` and check it; on success it is set as ``policy.tokenizer``.

    Checks: it loads (a hub id offline fails at once, :mod:`mrl_lightning.model.hub`), ``pad_token``
    is in its vocabulary, it has an EOS and a pad token, its chat template when
    ``chat_template`` (:func:`mrl_lightning.model.chat.chat_template_errors`), and that two unlike
    questions give different prompt ids (:func:`prompt_collision_errors`).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    from transformers import AutoTokenizer

    p = f"policy {policy.policy_name!r}"
    try:  # a hub id without network fails here at once (mrl_lightning.model.hub)
        hub = hub_load_kwargs(source, "tokenizer" if policy.tokenizer_source else "model", p, "tokenizer_config.json")
    except HubUnreachableError as exc:
        return [str(exc)]
    if looks_local(source) and (missing := tokenizer_files_problem(source)):  # before transformers makes do
        field = "tokenizer" if policy.tokenizer_source else "model"
        return [f"{p}: {field}={source!r} holds no tokenizer files: {missing}. Save the tokenizer into it "
                "(tok.save_pretrained(<folder>)), or give tokenizer: <its folder or hub id>."]
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(source), **hub)
    except Exception as exc:  # noqa: BLE001 - reported as a config error with its cause
        return [f"{p}: tokenizer {source!r} could not be loaded ({type(exc).__name__}: {exc})."]
    if policy.pad_token is not None:
        tok.pad_token = policy.pad_token
    if policy.pad_token is not None and policy.pad_token not in tok.get_vocab():
        return [f"{p}: pad_token={policy.pad_token!r} is not in the vocabulary of tokenizer {source!r}; use a "
                f"token it has, e.g. its EOS pad_token: {tok.eos_token!r}."]
    if tok.eos_token_id is None:  # before the pad check, whose advice is the EOS text
        return [f"{p}: tokenizer {source!r} has no EOS token (eos_token=None), so a completion could never "
                "finish and the loss mask would have no end. Use a tokenizer that defines one, or add it: "
                "tok.add_special_tokens({'eos_token': '</s>'}); tok.save_pretrained(<folder>) and point "
                "tokenizer: at that folder (the model's vocabulary must hold the new id)."]
    if tok.pad_token_id is None:
        return [f"{p}: tokenizer {source!r} has no pad token. Set pad_token: '<its EOS text>' in this "
                f"policy's config (here: pad_token: {tok.eos_token!r})."]
    if policy.chat_template:
        errors = chat_template_errors(p, tok)
        if errors:
            return errors
    policy.tokenizer = tok
    errors = prompt_collision_errors(policy)  # two questions, one prompt: template or truncation
    if errors:
        policy.tokenizer = None
    return errors


def package_errors(models: list[tuple[str, object]]) -> list[str]:
    """What this environment lacks for each ``(policy name, model value)``: a packaged model's distribution,
    a GGUF file, the ``gguf`` package (:meth:`GGUFModel.source_errors
    <mrl_lightning.gguf.GGUFModel.source_errors>`), every policy's at once; each line names the policy, the value
    and the install command (docs/real_models.md, "Installing"). Other values give nothing here.
    """
    from mrl_lightning.gguf import model_from_string

    errors = []
    for name, model in models:
        try:
            source = model_from_string(model) if isinstance(model, str) else None
        except ValueError:  # ConfigError: an unknown pypi: name, which the policy's own check words
            continue
        if isinstance(source, ModelRecipe):
            errors.extend(source.source_errors(f"policy {name!r}"))
    return errors


def part_errors(policy, index: int, parts: list[str] | None) -> list[str]:
    """One message per part of ``policy``'s ``strong_parts`` that the data lacks (``parts``: its part names; None =
    not known), naming the policy (``index`` in ``model.policies``), the part and the data's parts. Such a part was
    never drawn: every part counted as the policy's weak one, its ``_strong`` log tags stayed empty, no word."""
    if parts is None or not policy.strong_parts:
        return []
    errors = []
    for part in [x for x in policy.strong_parts if x not in parts]:
        near = difflib.get_close_matches(part, parts, n=1, cutoff=0.4)
        errors.append(f"policy {policy.policy_name!r}: model.policies[{index}].init_args.strong_parts names part "
                      f"{part!r}, which is not a part of the data; the data's parts (data.init_args.parts names) are "
                      f"{parts}. Name one of them" + (f", e.g. {near[0]!r}." if near else "."))
    return errors


def position_errors(policy) -> list[str]:
    """A prompt plus completion longer than the positions of the model a recipe builds (read from the
    recipe's config; a folder's or hub id's model is not read here).

    Returns:
        Error messages naming the fields, the values and the fix (empty when they fit or the
        model is not a recipe's).
    """
    source = policy.model_source
    if not isinstance(source, ModelRecipe):
        return []
    try:
        config = source.model_config()
    except Exception:  # noqa: BLE001 - the recipe reports its own errors when it builds
        return []
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    total = policy.max_prompt_length + policy.max_completion_length
    if positions and total > positions:
        key = "n_positions" if getattr(config, "model_type", "") == "gpt2" else "max_position_embeddings"
        return [f"policy {policy.policy_name!r}: max_prompt_length={policy.max_prompt_length} + "
                f"max_completion_length={policy.max_completion_length} = {total} tokens, but the model takes "
                f"{positions} positions. Lower them, or give the recipe config_overrides: {{{key}: {total}}}."]
    return []


def memory_option_errors(where: str, policy) -> list[str]:
    """Problems of a policy's LoRA / gradient-checkpointing options that need no model.

    Whether the target modules exist is checked against the model's config before any
    weight is loaded (:func:`mrl_lightning.builders.models.adapter_errors`).

    Returns:
        Error messages naming the field, the value and the fix (empty when valid).
    """
    import importlib.util

    errors = []
    if policy.use_peft and importlib.util.find_spec("peft") is None:
        errors.append(f"{where}: use_peft=true needs the peft package, not installed here: pip install peft "
                      "(or set use_peft: false).")
    if policy.lora_r < 1:
        errors.append(f"{where}: lora_r={policy.lora_r} must be >= 1 (the adapter's rank, e.g. 16).")
    if not policy.lora_alpha > 0:
        errors.append(f"{where}: lora_alpha={policy.lora_alpha} must be > 0 (e.g. 2 * lora_r).")
    if not 0.0 <= policy.lora_dropout < 1.0:
        errors.append(f"{where}: lora_dropout={policy.lora_dropout} must be in [0, 1).")
    if policy.fsdp and policy.use_peft:
        errors.append(f"{where}: fsdp=true with use_peft=true is not supported (a sharded LoRA adapter); use one "
                      "of them (LoRA alone keeps the frozen base unsharded, FSDP alone shards every weight).")
    if policy.fsdp and policy.rollout_engine == "vllm":
        errors.append(f"{where}: fsdp=true with rollout_engine=vllm is not supported (the engine's weight push "
                      "needs the full weights); use rollout_engine: hf with FSDP, or LoRA to fit the policy.")
    return errors
