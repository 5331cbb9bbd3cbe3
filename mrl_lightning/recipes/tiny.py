"""TinyCausalLM: a tiny model of a chosen family, warm-started and cached on disk.

The embedded default (docs/default.md) needs policies of different families that start good at
one part of the task and unable to do the other. This recipe:

1. trains a small tokenizer on the task text, or takes a real one from the mistral-common
   wheel at its full vocabulary (``recipes/tokenizers.py``); when the policy renders its
   prompts through a chat template (``chat_template: true``), gives it the family's chat
   format: the template, saved with the tokenizer, and its special tokens
   (``recipes/families.py``). A policy with a plain ``prompt_template`` gets neither, so
   its tokenizer and model are those the recipe built before it had chat formats;
2. builds a small model of the family from its config (GPT-2, Llama, Qwen2, Mistral or
   Phi-3: ``*Config`` + ``*ForCausalLM(config)``), no hub needed; with a chat format whose
   turn ends with a token of its own, the model's ``generation_config`` lists it in
   ``eos_token_id`` next to EOS,
3. warm-starts it by supervised training on ``warm_start_part`` only, with the
   policy's own prompt template and completions retokenized exactly as the policy would
   receive a peer's text (THL ``retokenize``), each completion ending with the token that
   ends a turn in the policy's format (EOS, or the chat format's end of turn,
   ``recipes/sft.py``), until greedy accuracy on that part's *validation* prompts reaches
   ``warm_start_target`` or ``warm_start_steps`` run out (:func:`warm_start_split`:
   ``warm_start_val_size`` training prompts per part, set apart before the warm-start,
   never trained on by it and never an evaluation question; the held-out evaluation
   prompts are never looked at, so the step-0 evaluation is not selected on); a
   warm-start that ends below its target says so in a ``warning:`` line naming the policy,
   the reached accuracy and the target, and records ``target_reached: false`` with the
   same line in ``warm_start.json`` (the line is printed again on every cache hit),
4. saves model and tokenizer with ``save_pretrained`` into a cache folder named by a
   hash of everything above; the policy then loads it with ``from_pretrained``, the
   same path a user's own checkpoint takes. A second run finds the folder and skips
   1-3. The folder is written under a temporary name and renamed, so an interrupted
   warm-start never leaves a half-written cache entry.

Budgets are in steps, not wall-clock, so a busy machine changes the time, not the result.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mrl_lightning.errors import ConfigError
from mrl_lightning.model.source import ModelRecipe, default_cache_dir  # noqa: F401 - also imported from here
from mrl_lightning.recipes.families import (
    CHAT_FORMATS,
    FAMILIES,
    apply_chat_format,
    build_model,
    chat_corpus_text,
    config_override_errors,
)
from mrl_lightning.recipes.families import model_config as family_config
from mrl_lightning.recipes.warm_start import warm_start_shortfall, warm_start_split  # noqa: F401 - also imported from here
from mrl_lightning.writable import write_problem


def save_model(model, out: Path) -> None:
    """``model.save_pretrained(out)``, also from a process that is not rank 0.

    transformers' ``save_pretrained`` silently writes nothing on a rank other than 0 once
    ``torch.distributed`` is initialized, which is where a policy's recipe runs when its
    group of ranks does not include rank 0. There the config, generation config and
    weights are written with the same formats (``safetensors.torch.save_model`` drops tied
    copies, as ``save_pretrained`` does), so ``from_pretrained`` reads them back alike.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        model.save_pretrained(str(out))
        return
    from safetensors.torch import save_model as save_safetensors

    model.config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    save_safetensors(model, str(out / "model.safetensors"), metadata={"format": "pt"})


class TinyCausalLM(ModelRecipe):
    """Recipe for a tiny, optionally warm-started causal LM.

    Args:
        family: The architecture and its chat format: "gpt2", "llama", "qwen2", "mistral" or
            "phi3" (``recipes/families.py``).
        tokenizer_kind: Trained on the task text: "byte_level_bpe" (GPT-2 style),
            "sentencepiece_bpe" (Llama 2 style), "char_level" or "qwen2_bpe" (Qwen2 style);
            real, from the mistral-common wheel: "mistral_v1" (32,000 tokens), "mistral_v3"
            (32,768) or "tekken" (131,072). A real vocabulary makes the model far larger and
            slower on a CPU (2 layers, width 128: 4.5 M parameters at 32,768 tokens, 17.1 M at
            131,072): use a narrow one (width 64: 2.2 M at 32,768).
        vocab_size: Vocabulary size a trained BPE is asked for (ignored by char_level and the
            real kinds).
        hidden_size: Model width.
        num_layers: Transformer layers.
        num_heads: Attention heads.
        warm_start_part: Task part to warm-start on; None = random init.
        warm_start_steps: Maximum supervised steps.
        warm_start_target: Stop early at this greedy accuracy on the part's validation
            prompts (:func:`warm_start_split`, never the held-out evaluation prompts); a
            warm-start that ends below it prints a warning line (see :func:`warm_start_shortfall`).
        warm_start_val_size: Validation prompts per part, set apart from the training prompts
            before the warm-start and never trained on by it (:func:`warm_start_split`).
        warm_start_batch_size: Examples per supervised step.
        warm_start_lr: AdamW learning rate of the warm-start.
        eval_every: Supervised steps between accuracy checks.
        seed: Seed of init and warm-start.
        cache_dir: Root of the cache; None = ``$MRL_CACHE_DIR`` or ``~/.cache/mrl_lightning``.
        config_overrides: Keys of the family's ``transformers`` config set over the recipe's
            own, e.g. a real model's shape scaled down: ``{intermediate_size: 1408,
            num_key_value_heads: 1, rope_parameters: {rope_type: default, rope_theta: 1000000.0},
            max_position_embeddings: 1024}`` (the recipe's models have 256 positions; GPT-2's are
            ``n_positions``). Width, layers, heads and token ids come from the arguments above
            and the tokenizer. None = the recipe's config (``recipes/families.py``).
        prebuilt: A folder this recipe wrote before (e.g. shipped with the repository:
            ``models/default/gpt2``), used instead of building when its ``warm_start.json``
            records the same recipe, templates and data; otherwise the recipe builds as
            usual (and says why). The same starting weights on every machine: a warm-start
            rebuilt on another CPU ends elsewhere (docs/default.md). Not part of the cache key.

    Raises:
        ValueError: unknown family / tokenizer kind, non-positive sizes, or config overrides the
            family's config does not take (all at once).
    """

    def __init__(
        self,
        family: str = "gpt2",
        tokenizer_kind: str = "byte_level_bpe",
        vocab_size: int = 320,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        warm_start_part: str | None = None,
        warm_start_steps: int = 2000,
        warm_start_target: float = 0.9,
        warm_start_val_size: int = 100,
        warm_start_batch_size: int = 64,
        warm_start_lr: float = 1e-3,
        eval_every: int = 100,
        seed: int = 0,
        cache_dir: str | None = None,
        config_overrides: dict[str, Any] | None = None,
        prebuilt: str | None = None,
    ) -> None:
        from mrl_lightning.recipes.tokenizers import TOKENIZER_KINDS

        errors = []
        if family not in FAMILIES:
            errors.append(f"TinyCausalLM.family={family!r}; valid: {list(FAMILIES)}.")
        if tokenizer_kind not in TOKENIZER_KINDS:
            errors.append(f"TinyCausalLM.tokenizer_kind={tokenizer_kind!r}; valid: {list(TOKENIZER_KINDS)}.")
        for key, value in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads),
                           ("warm_start_batch_size", warm_start_batch_size), ("eval_every", eval_every),
                           ("warm_start_val_size", warm_start_val_size)):
            if value < 1:
                errors.append(f"TinyCausalLM.{key}={value} must be >= 1.")
        if num_heads >= 1 and hidden_size % num_heads:
            up, down = -(-hidden_size // num_heads) * num_heads, hidden_size // num_heads * num_heads
            heads = [h for h in range(num_heads, 0, -1) if hidden_size % h == 0][0]
            errors.append(f"TinyCausalLM.hidden_size={hidden_size} must be divisible by num_heads={num_heads}: set "
                          f"hidden_size: {up}" + (f" (or {down})" if down >= 1 else "")
                          + f", or num_heads: {heads} (a divisor of {hidden_size}).")
        if config_overrides and family in FAMILIES:
            errors.extend(config_override_errors(family, config_overrides))
        if errors:
            raise ConfigError("Invalid TinyCausalLM config:\n  - " + "\n  - ".join(errors))
        self.family, self.tokenizer_kind, self.vocab_size = family, tokenizer_kind, vocab_size
        self.hidden_size, self.num_layers, self.num_heads = hidden_size, num_layers, num_heads
        self.warm_start_part, self.warm_start_steps = warm_start_part, warm_start_steps
        self.warm_start_target, self.warm_start_batch_size = warm_start_target, warm_start_batch_size
        self.warm_start_val_size = warm_start_val_size
        self.warm_start_lr, self.eval_every, self.seed = warm_start_lr, eval_every, seed
        self.cache_dir, self.prebuilt = cache_dir, prebuilt
        self.config_overrides = dict(config_overrides) if config_overrides else None

    @property
    def strong_parts(self) -> list[str] | None:
        """``[warm_start_part]`` when the model is warm-started on a part, else None."""
        return [self.warm_start_part] if self.warm_start_part else None

    def _args(self) -> dict[str, Any]:
        """The arguments that shape the build (no overrides: the keys of a recipe from before they existed)."""
        return {k: v for k, v in vars(self).items()
                if k not in ("cache_dir", "prebuilt") and not (k == "config_overrides" and v is None)}

    def cache_key(self, policy, datamodule) -> str:
        """Hash of recipe, templates (the chat format and system prompt under ``chat_template``),
        data and the versions of the libraries that build it (mistral-common's too for a real
        tokenizer). torch and transformers shape the model and its training; tokenizers trains
        the tokenizer, whose merges can change between its releases."""
        import tokenizers
        import transformers

        from mrl_lightning.recipes.tokenizers import REAL_KINDS

        content = {**self.identity(policy, datamodule), "transformers": transformers.__version__,
                   "torch": torch.__version__, "tokenizers": tokenizers.__version__}
        if self.tokenizer_kind in REAL_KINDS:
            from importlib.metadata import version

            content["mistral_common"] = version("mistral-common")
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]

    def identity(self, policy, datamodule) -> dict[str, Any]:
        """What the built folder is, apart from the libraries: recipe, templates (the chat format
        and system prompt under ``chat_template``) and data (recorded in ``warm_start.json``)."""
        content = {"recipe": self._args(), "prompt": policy.prompt_template, "completion": policy.completion_template,
                   "data": datamodule.fingerprint() if datamodule is not None else None,
                   "v": 2}  # 2: selects on its own validation split, not on the evaluation prompts
        if getattr(policy, "chat_template", False):
            fmt = CHAT_FORMATS[self.family]
            content["chat"] = {"template": fmt.template, "special_tokens": list(fmt.special_tokens),
                               "end_of_turn": fmt.end_of_turn, "system_prompt": policy.system_prompt}
        return content

    def _prebuilt_folder(self, policy, datamodule, log) -> Path | None:
        """``prebuilt`` when it holds this recipe's build (same :meth:`identity`), else None (logged why)."""
        if self.prebuilt is None:
            return None
        folder = Path(self.prebuilt).expanduser()
        report_file = folder / "warm_start.json"
        name = policy.policy_name
        if not report_file.is_file():
            log(f"[{name}] prebuilt={str(folder)!r} holds no warm_start.json (run from the repository root for a "
                "relative path); building the model instead.")
            return None
        recorded = json.loads(report_file.read_text()).get("identity")
        if recorded != json.loads(json.dumps(self.identity(policy, datamodule))):
            log(f"[{name}] prebuilt={str(folder)!r} was built from other recipe, template or data settings; "
                "building the model for these instead.")
            return None
        return folder

    def cache_folder(self, policy, datamodule) -> Path:
        """Where this recipe's model for ``policy`` and ``datamodule`` is (or will be) cached."""
        root = Path(self.cache_dir or default_cache_dir()).expanduser() / "models"
        return root / f"{self.family}-{self.tokenizer_kind}-{self.cache_key(policy, datamodule)}"

    def built_folder(self, policy, datamodule) -> Path | None:
        """The cached folder when an earlier run built it (a cache hit), else None."""
        folder = self.cache_folder(policy, datamodule)
        return folder if (folder / "warm_start.json").is_file() else None

    def config_errors(self, policy, datamodule) -> list[str]:
        """``warm_start_part`` not a part of the data, or a cache miss whose cache folder cannot be written.

        Checked before any model is built (the trainer's config-time checks), so neither is
        found minutes into a run, or only on the rank that builds this policy.
        """
        p, errors = f"policy {policy.policy_name!r}", []
        parts = [part.name for part in datamodule.parts]
        if self.warm_start_part is not None and self.warm_start_part not in parts:
            near = difflib.get_close_matches(self.warm_start_part, parts, n=1, cutoff=0.4)
            errors.append(f"{p}: TinyCausalLM.warm_start_part={self.warm_start_part!r} is not a part of the data; "
                          f"the data parts (data.parts names) are {parts}. Set warm_start_part to one of them"
                          + (f", e.g. {near[0]!r}." if near else "."))
        elif self.built_folder(policy, datamodule) is None:
            root = self.cache_folder(policy, datamodule).parent
            problem = write_problem(root)
            if problem is not None:
                field = (f"TinyCausalLM.cache_dir={self.cache_dir!r}" if self.cache_dir else
                         f"MRL_CACHE_DIR={os.environ['MRL_CACHE_DIR']!r}" if os.environ.get("MRL_CACHE_DIR") else
                         f"the model cache {str(root.parent)!r} (MRL_CACHE_DIR unset)")
                errors.append(f"{p}: {field} cannot be written ({problem}), and this recipe's model is not built "
                              "yet: it is built into the cache. Set MRL_CACHE_DIR (or TinyCausalLM.cache_dir) to a "
                              "folder you can write.")
        return errors + self._prebuilt_errors(p)

    def _prebuilt_errors(self, p: str) -> list[str]:
        """A ``prebuilt`` folder that does not exist (a typo would warm-start for minutes on a cache miss)."""
        folder = Path(self.prebuilt).expanduser() if self.prebuilt else None
        if folder is None or folder.is_dir():
            return []
        where = f"TinyCausalLM.prebuilt={self.prebuilt!r}"
        parent = folder.parent
        if not parent.is_dir():
            return [f"{p}: {where} does not exist, nor does its folder {str(parent)!r} (from {os.getcwd()!r}; a "
                    "relative path is read from the folder mrl runs in: run from the repository root). Give the "
                    "folder a recipe wrote (e.g. models/default/gpt2), or prebuilt: null to build the model."]
        names = sorted(x.name for x in parent.iterdir() if x.is_dir())
        near = [str(parent / n) for n in difflib.get_close_matches(folder.name, names, n=3, cutoff=0.5)]
        hint = (f"did you mean {' or '.join(map(repr, near))}?" if near else
                f"the folders in {str(parent)!r} are {names[:12]}.")
        return [f"{p}: {where} is not a folder; {hint} Give the folder a recipe wrote, or prebuilt: null to build "
                "the model."]

    def materialize(self, policy, datamodule, log: Callable[[str], None] = print,
                    warn_shortfall: bool = True) -> Path:
        """Return the cached folder, building it first if absent.

        Args:
            policy: The PolicyModule (its templates shape the corpus and warm-start).
            datamodule: Supplies task text and the warm-start part's prompts.
            log: Where progress lines go.
            warn_shortfall: On a cache hit, repeat the warning of a warm-start that ended below
                its target (False when a resumed run takes its weights from a checkpoint).

        Raises:
            ValueError: ``warm_start_part`` is not a part of the data module.
        """
        final = self.cache_folder(policy, datamodule)
        root = final.parent
        if (final / "warm_start.json").is_file():
            log(f"[{policy.policy_name}] warm-start cache hit: {final}")
            if warn_shortfall:
                self._say_shortfall(policy, final, log)
            return final
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            prebuilt = self._prebuilt_folder(policy, datamodule, log)
            if prebuilt is not None:  # the same weights on every machine (docs/default.md)
                shutil.rmtree(tmp)
                shutil.copytree(prebuilt, tmp)
                log(f"[{policy.policy_name}] warm-started model taken from {prebuilt} (prebuilt)")
                if warn_shortfall:  # said as on a cache hit: the shipped build fell short too
                    self._say_shortfall(policy, tmp, log)
            else:
                self._build(policy, datamodule, tmp, log)
            if final.exists():  # another process finished first
                shutil.rmtree(tmp)
            else:
                os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _say_shortfall(self, policy, folder: Path, log) -> None:
        """Log the warning of the warm-start stored in ``folder`` if it ended below its target."""
        report = json.loads((folder / "warm_start.json").read_text())
        warning = warm_start_shortfall(policy.policy_name, self.warm_start_part, report.get("accuracy", {}),
                                       self.warm_start_target, report.get("steps", 0))
        if warning:
            log(warning)

    # --------------------------------------------------------------------- build
    def _build(self, policy, datamodule, out: Path, log) -> None:
        from transformers import AutoTokenizer

        from mrl_lightning.recipes.tokenizers import train_tokenizer

        parts = [p.name for p in datamodule.parts]
        if self.warm_start_part is not None and self.warm_start_part not in parts:
            raise ValueError(f"TinyCausalLM.warm_start_part={self.warm_start_part!r} is not a data part; "
                             f"valid: {parts}.")
        chat = getattr(policy, "chat_template", False)
        corpus = []  # under a chat format, its text around the prompt; its special tokens are added whole
        for part in parts:
            for item in datamodule.train_items(part)[:2000]:
                user, answer = policy.prompt_template.format(question=item.question), policy.render_completion(item)
                corpus.append(chat_corpus_text(self.family, user, answer, policy.system_prompt) if chat
                              else user + answer)
        root = Path(self.cache_dir or default_cache_dir()).expanduser()
        tokenizer = train_tokenizer(self.tokenizer_kind, corpus, self.vocab_size, out, cache_dir=root / "tokenizers")
        stop_ids = None
        if chat:
            end_of_turn, eos = apply_chat_format(tokenizer, self.family)
            stop_ids = None if end_of_turn == eos else [eos, end_of_turn]
            tokenizer.save_pretrained(str(out))
        tokenizer = AutoTokenizer.from_pretrained(str(out))
        torch.manual_seed(self.seed)
        model = self._model(tokenizer)
        if stop_ids is not None:  # as chat models list theirs: a turn ends at either
            model.generation_config.eos_token_id = stop_ids
        report: dict[str, Any] = {"recipe": self._args(), "identity": self.identity(policy, datamodule), "steps": 0,
                                  "accuracy": {}, "seconds": 0.0}
        if self.warm_start_part is not None:
            report.update(self._warm_start(model, tokenizer, policy, datamodule, log))
        save_model(model, out)
        tokenizer.save_pretrained(str(out))
        (out / "warm_start.json").write_text(json.dumps(report, indent=2))

    def model_config(self, vocab_size: int | None = None, **token_ids):
        """The ``transformers`` config this recipe builds (vocabulary ``vocab_size``; default the size
        asked for, or a real tokenizer's own, without a chat format's added tokens)."""
        from mrl_lightning.recipes.tokenizers import REAL_VOCAB

        vocab = vocab_size or REAL_VOCAB.get(self.tokenizer_kind, self.vocab_size)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token_ids.setdefault(key, None)  # the plan's estimate needs none; GPT-2's defaults lie outside V
        return family_config(self.family, vocab, self.hidden_size, self.num_layers, self.num_heads,
                             overrides=self.config_overrides, **token_ids)

    def _model(self, tokenizer):
        cfg = self.model_config(len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return build_model(cfg)

    def _warm_start(self, model, tokenizer, policy, datamodule, log) -> dict[str, Any]:
        from mrl_lightning.recipes.sft import greedy_accuracy, sft_batches, sft_loss

        part = self.warm_start_part
        policy_tok, policy.tokenizer = policy.tokenizer, tokenizer
        try:
            rng = random.Random(self.seed)
            items, evals = warm_start_split(datamodule, part, self.warm_start_val_size, self.seed)
            opt = torch.optim.AdamW(model.parameters(), lr=self.warm_start_lr)
            start, acc, step = time.perf_counter(), {}, 0
            model.train()
            for step, (ids, attn, labels) in enumerate(
                sft_batches(policy, items, self.warm_start_batch_size, rng), start=1
            ):
                loss = sft_loss(model, ids, attn, labels)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step % self.eval_every == 0 or step >= self.warm_start_steps:
                    acc = {name: greedy_accuracy(policy, model, its) for name, its in evals.items()}
                    log(f"[{policy.policy_name}] warm-start step {step}: loss {loss.item():.3f} "
                        f"greedy accuracy on validation prompts {acc} ({time.perf_counter() - start:.0f} s)")
                    if acc[part] >= self.warm_start_target or step >= self.warm_start_steps:
                        break
            warning = warm_start_shortfall(policy.policy_name, part, acc, self.warm_start_target, step)
            if warning:
                log(warning)
            return {"steps": step, "accuracy": acc, "seconds": time.perf_counter() - start,
                    "selected_on": "validation", "validation_size": {k: len(v) for k, v in evals.items()},
                    "sft_prompts": len(items),
                    "target": self.warm_start_target, "target_reached": warning is None, "warning": warning}
        finally:
            policy.tokenizer = policy_tok
