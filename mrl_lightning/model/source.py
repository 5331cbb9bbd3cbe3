"""Where a policy's model comes from: a local folder, a hub id, or a recipe that builds a folder.

The policy depends on :class:`ModelRecipe`, the interface; recipes (e.g.
:class:`~mrl_lightning.recipes.TinyCausalLM`, :class:`~mrl_lightning.gguf.GGUFModel`) implement
it, so a new recipe needs no change to the policy. ``model:`` in YAML takes either a string
(folder, hub id, a ``.gguf`` file or ``pypi:<name>``: docs/real_models.md) or a recipe's
``class_path``. Recipes cache what they build under :func:`default_cache_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


SENTENCEPIECE_FAMILIES = ("llama", "mistral", "gemma", "gemma2", "gemma3", "gemma3_text", "t5", "mt5", "qwen2_moe")
"""Model types whose slow tokenizer is a SentencePiece ``tokenizer.model`` (the others': ``vocab.json`` +
``merges.txt``), for :func:`tokenizer_files_problem`'s message."""


def tokenizer_files_problem(folder: str | Path) -> str | None:
    """Why a model folder cannot give its tokenizer: it holds none of a tokenizer's files (``tokenizer.json``, a
    SentencePiece ``*.model``, ``tekken.json``, ``vocab.txt``, ``vocab.json`` with ``merges.txt``); None when it
    holds one, or is not a folder.

    transformers 5.25 loads such a folder without an error, as a tokenizer of one token, so every later check
    (no pad token, then a ``max_prompt_length`` every prompt is cut to) would point elsewhere. The message names
    the files its ``config.json``'s ``model_type`` implies (docs/real_models.md, "A GGUF file as a policy's model").
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    names = {p.name for p in folder.iterdir()}
    if (names & {"tokenizer.json", "tekken.json", "vocab.txt"} or {"vocab.json", "merges.txt"} <= names
            or any(n.endswith((".model", ".tiktoken")) for n in names)):
        return None
    try:
        import json

        family = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        family = None
    slow = "tokenizer.model (SentencePiece)" if family in SENTENCEPIECE_FAMILIES else "vocab.json + merges.txt"
    if family is None:
        slow = "a slow tokenizer's files (tokenizer.model, or vocab.json + merges.txt)"
    return f"a{'n' if str(family)[:1] in 'aeiou' else ''} {family or 'causal LM'} model's tokenizer is " \
           f"tokenizer.json, or {slow}, and the folder has neither"


def default_cache_dir() -> str:
    """The model cache's root: ``$MRL_CACHE_DIR``, or ``~/.cache/mrl_lightning`` when it is unset."""
    return os.environ.get("MRL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "mrl_lightning"))


class ModelRecipe:
    """A recipe that writes a folder ``AutoModelForCausalLM.from_pretrained`` can load.

    Subclasses implement :meth:`materialize` and :meth:`model_config`; they keep their
    settings as instance attributes (a recipe's cache key may hash them).
    """

    def materialize(self, policy, datamodule, log: Callable[[str], None] = print,
                    warn_shortfall: bool = True) -> Path:
        """Build (or find in a cache) the folder, and return it.

        Args:
            policy: The :class:`~mrl_lightning.policy.PolicyModule` (templates, name).
            datamodule: The data module (corpus, warm-start prompts).
            log: Where progress lines go.
            warn_shortfall: Repeat a cached build's warning (e.g. a warm-start below its target).

        Raises:
            ValueError: the recipe does not fit the data (named by the subclass).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement materialize()")

    def model_config(self):
        """The ``transformers`` config this recipe builds, without building it (vocabulary at its upper bound)."""
        raise NotImplementedError(f"{type(self).__name__} must implement model_config()")

    def config_errors(self, policy, datamodule) -> list[str]:
        """Problems :meth:`materialize` would meet, found before anything is built (e.g. a task part the
        data does not have, a cache that cannot be written); each names the field and the fix."""
        return []

    def built_folder(self, policy, datamodule) -> Path | None:
        """The folder an earlier :meth:`materialize` left for this policy and data, or None (not built yet)."""
        return None

    def source_errors(self, where: str) -> list[str]:
        """Problems found when the policy is constructed, before anything is read or built: a package or
        file the recipe needs that is missing here; each names the field, the value and the install line.

        Args:
            where: Prefix naming the config entry, e.g. ``"policy 'smol'"``.
        """
        return []

    def describe(self, policy, datamodule) -> str | None:
        """One line for the printed resource plan: what the policy's model is loaded from (file,
        quantization, sha256) and whether it is built yet; None = nothing to add."""
        return None

    def provenance(self, policy, datamodule) -> dict | None:
        """What the built folder was made from, written into the run folder (``model_sources.json``);
        None = nothing to record (or not built yet)."""
        return None

    @property
    def config_is_exact(self) -> bool:
        """True when :meth:`model_config` is exactly what :meth:`materialize` builds (e.g. a converted file);
        False when its sizes are upper bounds (a vocabulary trained at build time), as the plan marks them."""
        return False

    @property
    def strong_parts(self) -> list[str] | None:
        """Task parts the built model starts good at (a warm-start's part); None = not known."""
        return None


def looks_local(path: str) -> bool:
    """True when ``path`` reads as a local path (``.``, ``/``, ``~`` or an existing path with a separator)."""
    return path.startswith((".", "/", "~")) or os.path.isabs(path) or os.sep in path and os.path.exists(path)
