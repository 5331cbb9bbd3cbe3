"""The warm-start's stop rule and its own validation split (:class:`~mrl_lightning.recipes.tiny.TinyCausalLM`; docs/default.md).

Pure functions on a data module's prompts; nothing heavy is imported, so the recipe's
config-time checks stay cheap.
"""

from __future__ import annotations

import random


def warm_start_shortfall(
    policy_name: str, part: str | None, accuracy: dict[str, float], target: float, steps: int
) -> str | None:
    """The warning line for a warm-start that ended below its target; None when it reached it.

    Args:
        policy_name: The policy the recipe built.
        part: ``warm_start_part`` (None: no warm-start, so nothing to miss).
        accuracy: Greedy accuracy per data part at the last check, in [0, 1].
        target: ``warm_start_target``, in [0, 1].
        steps: Supervised steps run.

    Returns:
        ``"[<policy>] warning: warm-start stopped at step <steps> below its target: greedy
        accuracy <a> on '<part>' < warm_start_target <t> ..."``, or None.
    """
    if part is None:
        return None
    reached = accuracy.get(part)
    if reached is not None and reached >= target:
        return None
    shown = "not measured" if reached is None else f"{reached:.2f}"
    return (f"[{policy_name}] warning: warm-start stopped at step {steps} below its target: greedy accuracy "
            f"{shown} on {part!r} < warm_start_target {target:g}. Training starts from this model; raise "
            "warm_start_steps (or lower warm_start_target) for a stronger start.")


def warm_start_split(datamodule, part: str, size: int, seed: int) -> tuple[list, dict[str, list]]:
    """The warm-start's own validation prompts, and the prompts it may train on.

    For every data part, ``min(size, n // 2)`` of its n training prompts are drawn (seeded by
    ``seed`` and the part's name, so the split is the same on every run and machine) as that
    part's validation prompts, leaving out any whose question is also a held-out evaluation
    question. The supervised prompts are ``part``'s training prompts whose question is none
    of the validation questions (of any part) nor an evaluation question. The warm-start
    selects (stops) on the validation prompts only: the held-out evaluation prompts stay
    unseen, so the first evaluation of a run is not biased upwards by the selection.

    Args:
        datamodule: A prompt data module (``parts``, ``train_items(part)``, ``eval_items()``).
        part: ``warm_start_part``, the part trained on.
        size: ``warm_start_val_size``, validation prompts per part (>= 1).
        seed: The recipe's seed.

    Returns:
        ``(sft_items, validation)``: the prompts of ``part`` to train on, and part name ->
        validation prompts.

    Raises:
        ValueError: ``part`` is not a data part, or no prompt of ``part`` is left to train on.
    """
    parts = [p.name for p in datamodule.parts]
    if part not in parts:
        raise ValueError(f"TinyCausalLM.warm_start_part={part!r} is not a data part; valid: {parts}.")
    held = {x.question for items in datamodule.eval_items().values() for x in items}
    validation = {}
    for name in parts:
        pool = [x for x in datamodule.train_items(name) if x.question not in held]
        validation[name] = random.Random(f"{seed}/warm-start-validation/{name}").sample(
            pool, min(size, len(pool) // 2))
    seen = held | {x.question for items in validation.values() for x in items}
    sft = [x for x in datamodule.train_items(part) if x.question not in seen]
    if not sft:
        raise ValueError(f"TinyCausalLM: no training prompt of part {part!r} is left for the warm-start once "
                         f"warm_start_val_size={size} validation prompts per part are set apart; lower "
                         "warm_start_val_size or raise data.train_size.")
    return sft, validation
