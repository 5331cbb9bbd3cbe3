"""MWRA by cost: predicted phase times per policy, and the placement with the shortest predicted step (docs/mwra.md,
"Placement by cost"; ``trainer.placement: cost``).

A short calibration, on this machine, at the run's precision: each policy's architecture is built from its config
with **one** decoder layer and a 256-token vocabulary (random weights; nothing is loaded) and timed at two row
counts (one prompt's group, and the whole batch on one rank): ``generate`` of ``C`` sampled tokens, a prefill of the
prompt, one decoding step over a KV cache half a completion long, and a forward + backward (and a no-grad forward)
over prompt + completion. The output head is timed apart, at the real vocabulary, as a ``[rows, h] x [h, V/k]``
slice scaled by ``k``: at decoding with its softmax and draw, at the update over the completions' tokens with its
log-softmax and backward. And one AdamW step per trained parameter. For ``R`` rows on a rank (linear between the
two row counts measured), ``L`` layers, ``P`` prompt tokens (the data's longest prompt when the config check
measured it, else ``max_prompt_length``) and ``C`` = ``max_completion_length``::

    sampling = generate(R) + (L - 1) * (prefill(R) + C * decode(R)) + C * head_step(R)
    update   = mu * (s * L * fwd_bwd(R) + head_fwd_bwd(R) + T * adamw) + forwards * (s * L * fwd(R) + head_fwd(R))

with ``mu`` = ``num_iterations``, ``forwards`` the no-grad log-prob passes (the reference model when ``beta > 0``,
the sampler's log-probs re-scored when ``num_iterations > 1``), ``s`` the share of prompt + completion tokens the
update runs (``(P / G + C) / (P + C)`` when each distinct prompt runs once for its group of ``G``) and ``T`` the
trained parameters. Every completion is taken to run to ``C`` tokens, so sampling is an upper bound where they stop
early. A group of ``n`` ranks splits the batch's prompts and all-reduces ``4 T`` bytes of gradients per optimizer step (a ring:
``2 (n - 1) / n`` of them at :data:`ALLREDUCE_BYTES_PER_S`, a constant, not measured). Not counted: the loop's own
work (rewards, the exchange, the probes, logging), which for tiny models is most of a step.

The step each placement predicts (lockstep: every policy's step ends at the exchange):

- ``disjoint`` with ``n_p`` ranks per policy: ``max_p (sampling_p + update_p)``; a policy's idle share is
  ``1 - its time / the step``;
- ``colocated`` on ``W`` ranks: ``sum_p (sampling_p + update_p)``, every policy data-parallel over the ``W``;
- on a CPU, one process with every core's threads (``--trainer.devices 1``), printed for comparison.

Everything but :func:`calibrate` and :func:`place_by_cost` is arithmetic on the calibration.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, field

ALLREDUCE_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 50.0e9}
"""Bytes a second one rank moves in a ring all-reduce: gloo between CPU processes, NCCL between the GPUs of one
node (orders of magnitude, not measured by the calibration)."""

CALIBRATION_VOCAB = 256
HEAD_SLICE = 16384


@dataclass
class PolicyCost:
    """One policy's calibration: seconds per unit, at two row counts ``rows`` (``(r1, r2)``), one worker's threads.

    Attributes:
        policy: Policy name.
        rows: The two row counts timed.
        prefill, decode, fwd_bwd, fwd: One layer: a prefill of the prompt, one decoding step, a forward + backward
            and a no-grad forward of prompt + completion, seconds, at each row count.
        generate: ``generate`` of ``C`` sampled tokens on the one-layer model (its own per-token work included).
        head_step, head_fwd_bwd, head_fwd: The output head at the real vocabulary: one decoding step's logits,
            softmax and draw; the update's logits, log-softmax and backward; a no-grad pass, seconds.
        adamw_per_param: One AdamW step, seconds per trained parameter.
        layers, prompt, completion, iterations, forwards, trained: The policy's ``L``, ``P``, ``C``, ``mu``,
            no-grad passes and trained parameters (module docstring).
        token_share: The update's tokens over ``rows x (P + C)``: ``(P / G + C) / (P + C)`` when each distinct prompt
            is run once for its group of ``G`` (``share_prompt_forward``), else 1.
    """

    policy: str
    rows: tuple[int, int]
    prefill: tuple[float, float]
    decode: tuple[float, float]
    generate: tuple[float, float]
    fwd_bwd: tuple[float, float]
    fwd: tuple[float, float]
    head_step: tuple[float, float]
    head_fwd_bwd: tuple[float, float]
    head_fwd: tuple[float, float]
    adamw_per_param: float
    layers: int
    prompt: int
    completion: int
    iterations: int = 1
    forwards: int = 0
    trained: int = 0
    token_share: float = 1.0

    def _at(self, pair: tuple[float, float], rows: int) -> float:
        (r1, r2), (t1, t2) = self.rows, pair
        if r2 == r1:
            return t1 * rows / r1
        return max(0.0, t1 + (t2 - t1) * (rows - r1) / (r2 - r1))

    def phases(self, rows: int) -> tuple[float, float]:
        """Predicted (sampling, update) seconds of one step with ``rows`` completions on this rank."""
        at = lambda pair: self._at(pair, rows)  # noqa: E731
        sampling = (at(self.generate) + (self.layers - 1) * (at(self.prefill) + self.completion * at(self.decode))
                    + self.completion * at(self.head_step))
        body = self.layers * self.token_share
        update = (self.iterations * (body * at(self.fwd_bwd) + at(self.head_fwd_bwd))
                  + self.forwards * (body * at(self.fwd) + at(self.head_fwd))
                  + self.iterations * self.trained * self.adamw_per_param)
        return sampling, update


@dataclass
class Prediction:
    """One candidate placement's predicted step.

    Attributes:
        mode: ``"disjoint"``, ``"colocated"`` or ``"one process"``.
        ranks: Ranks per policy (colocated: the world on each).
        phases: Policy -> (sampling, update, all-reduce) seconds on one of its ranks.
        step_s: Predicted seconds a step.
        idle: Policy -> the share of the step its ranks wait (disjoint; 0 otherwise).
    """

    mode: str
    ranks: dict[str, int]
    phases: dict[str, tuple[float, float, float]]
    step_s: float
    idle: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        parts = ", ".join(f"{p} {s:.2f} + {u:.2f}" + (f" + {a:.2f}" if a else "") + " s"
                          + (f" (idle {self.idle[p]:.0%})" if self.idle.get(p) else "")
                          for p, (s, u, a) in self.phases.items())
        where = ", ".join(f"{p}: {n}" for p, n in self.ranks.items())
        return f"{self.mode} ({where}): {self.step_s:.2f} s a step [sampling + update (+ all-reduce): {parts}]"


def policy_rows(policy, batch_size: int, ranks: int) -> int:
    """Completions one of ``ranks`` ranks samples and trains a step: its share of the prompts x the group size."""
    return -(-batch_size // ranks) * int(getattr(policy, "num_generations", 1) or 1)


def predict(costs: dict[str, PolicyCost], policies: dict, batch_size: int, ranks: dict[str, int], mode: str,
            device: str = "cpu") -> Prediction:
    """The predicted step of one placement (module docstring): ``ranks`` per policy, ``mode`` disjoint (the groups
    run at once: the slowest sets the step) or colocated / one process (every policy in turn)."""
    phases = {}
    for name, cost in costs.items():
        n = ranks[name]
        sampling, update = cost.phases(policy_rows(policies[name], batch_size, n))
        # one gradient all-reduce per optimizer step: num_iterations a step
        reduce_s = (cost.iterations * 2 * (n - 1) / n * 4 * cost.trained / ALLREDUCE_BYTES_PER_S.get(device, 1.0e9)
                    if n > 1 else 0.0)
        phases[name] = (sampling, update, reduce_s)
    totals = {name: sum(p) for name, p in phases.items()}
    if mode == "disjoint":
        step = max(totals.values())
        idle = {name: 1 - t / step if step else 0.0 for name, t in totals.items()}
    else:
        step, idle = sum(totals.values()), {}
    return Prediction(mode, dict(ranks), phases, step, idle)


def candidates(policy_names: list[str], world_size: int) -> list[tuple[str, dict[str, int]]]:
    """Every placement of ``world_size`` ranks: colocated, and each split of the ranks over the policies (disjoint,
    every policy at least one rank)."""
    out = [("colocated", {name: world_size for name in policy_names})]
    count = len(policy_names)
    if world_size >= count > 1:
        for cuts in itertools.combinations(range(1, world_size), count - 1):
            sizes = [b - a for a, b in zip((0, *cuts), (*cuts, world_size))]
            out.append(("disjoint", dict(zip(policy_names, sizes))))
    return out


def choose(costs: dict[str, PolicyCost], policies: dict, batch_size: int, world_size: int, device: str,
           allowed=None) -> list[Prediction]:
    """Every candidate's prediction (:func:`candidates`), shortest step first (ties: the order of
    :func:`candidates`, colocated first). Left out: candidates giving a policy more ranks than the batch has
    prompts, and those ``allowed(mode, ranks)`` refuses (the run's sharding checks). Empty when none is left."""
    found = [predict(costs, policies, batch_size, ranks, mode, device)
             for mode, ranks in candidates(list(policies), world_size)
             if max(ranks.values()) <= batch_size and (allowed is None or allowed(mode, ranks))]
    return sorted(found, key=lambda p: p.step_s)


def _precision_context(device: str, precision: str):
    import contextlib

    import torch

    if str(precision).startswith("bf16-mixed") or str(precision) == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    if str(precision).startswith("16-mixed") or str(precision) == "16":
        return torch.autocast(device, dtype=torch.float16)
    return contextlib.nullcontext()


def _best(fn, device: str, repeat: int = 3) -> float:
    """Fastest of ``repeat`` timed calls after one warm-up, seconds."""
    import torch

    fn()
    best = math.inf
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def one_layer_config(config):
    """A copy of a causal LM's config with one decoder layer and a :data:`CALIBRATION_VOCAB`-token vocabulary."""
    small = copy.deepcopy(config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(small, key, None):
            setattr(small, key, 1)
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:1]
    small.vocab_size = CALIBRATION_VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(small, key, None)
        if isinstance(value, int) and value >= CALIBRATION_VOCAB:
            setattr(small, key, 0)
        elif isinstance(value, list):
            setattr(small, key, [v if v < CALIBRATION_VOCAB else 0 for v in value])
    return small


def calibrate(name: str, policy, shape, batch_size: int, device: str, precision: str,
              threads: int | None = None) -> PolicyCost:
    """Time one policy's units on this machine (module docstring): 1-6 s a policy here (the real pair's 135M and 270M
    models at 1 thread), a fraction of a second for the tiny default's.

    Args:
        name: Policy name.
        policy: Its PolicyModule (num_generations, max_prompt_length, max_completion_length, num_iterations, beta,
            use_peft).
        shape: Its :class:`~mrl_lightning.mwra.memory.ModelShape`, with the config it was read from.
        batch_size: ``data.batch_size``: the larger row count is the whole batch's completions.
        device: ``"cpu"`` or ``"cuda"``.
        precision: The Fabric precision (``bf16-mixed`` times under bf16 autocast, as the run computes).
        threads: CPU threads to time with (restored after); None = as set.

    Returns:
        The :class:`PolicyCost`.

    Raises:
        Whatever transformers raises for a config it cannot build with one layer (:func:`place_by_cost` catches it
        and keeps the count rule).
    """
    import torch
    from transformers import AutoModelForCausalLM

    import inspect

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        group = int(policy.num_generations or 1)
        rows = (group, max(group, batch_size * group))
        # the data's longest prompt when the config check measured it, else the limit
        prompt = int(getattr(policy, "_data_prompt_tokens", None) or policy.max_prompt_length or 64)
        completion = int(policy.max_completion_length or 32)
        model = AutoModelForCausalLM.from_config(one_layer_config(shape.config)).to(device).float()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        params = sum(p.numel() for p in model.parameters())
        hidden, vocab = shape.hidden, shape.vocab
        width = min(vocab, HEAD_SLICE)
        head = torch.nn.Parameter(torch.randn(width, hidden, device=device) * 0.02)  # a leaf: autocast caches its cast
        scale = vocab / width
        cast = lambda: _precision_context(device, precision)  # noqa: E731
        gen = torch.Generator(device=device).manual_seed(0)
        out: dict[str, list[float]] = {k: [] for k in ("prefill", "decode", "generate", "fwd_bwd", "fwd", "head_step",
                                                       "head_fwd_bwd", "head_fwd")}
        for r in rows:
            ids = torch.randint(0, CALIBRATION_VOCAB, (r, prompt), device=device, generator=gen)
            full = torch.randint(0, CALIBRATION_VOCAB, (r, prompt + completion), device=device, generator=gen)
            with torch.no_grad(), cast():
                out["prefill"].append(_best(lambda: model(input_ids=ids, use_cache=True), device))
                half = model(input_ids=full[:, :prompt + completion // 2], use_cache=True)
                cache = getattr(half, "cache", None) or half.past_key_values  # "cache" in newer transformers
                key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
                step = full[:, -1:]
                # the cache grows by one token a call: four calls past half a completion
                decode = lambda: model(input_ids=step, use_cache=True, **{key: cache})  # noqa: E731
                out["decode"].append(_best(decode, device))
                out["fwd"].append(_best(lambda: model(input_ids=full), device))
                out["generate"].append(_best(lambda: model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=completion,
                    min_new_tokens=completion, do_sample=True, pad_token_id=0), device))

            def fwd_bwd():
                with cast():
                    model(input_ids=full).logits.float().sum().backward()
            out["fwd_bwd"].append(_best(fwd_bwd, device))
            x = torch.randn(r, hidden, device=device)
            xs = torch.randn(r * completion, hidden, device=device, requires_grad=True)  # log-probs: completions only

            def head_step():  # inside one autocast region, as generate runs: the weight is cast once
                torch.multinomial(torch.softmax(torch.nn.functional.linear(x, head).float(), -1), 1, generator=gen)

            def head_fwd_bwd():
                with cast():
                    torch.nn.functional.linear(xs, head).float().log_softmax(-1)[:, 0].sum().backward()

            def head_fwd():
                with torch.no_grad(), cast():
                    torch.nn.functional.linear(xs, head).float().log_softmax(-1)[:, 0].sum()
            with torch.no_grad(), cast():
                out["head_step"].append(_best(head_step, device) * scale)
            out["head_fwd_bwd"].append(_best(head_fwd_bwd, device) * scale)
            out["head_fwd"].append(_best(head_fwd, device) * scale)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        adamw = _best(opt.step, device) / params
        trained = shape.trainable or shape.params
        # a LoRA policy's reference is its base with the adapter off: no memory of its own, but a forward all the same
        forwards = (1 if getattr(policy, "beta", 0.0) else 0) + (
            1 if (getattr(policy, "num_iterations", 1) or 1) > 1 else 0)
        shared = getattr(policy, "share_prompt_forward", False) and not getattr(policy, "gradient_checkpointing", False)
        return PolicyCost(policy=name, token_share=(prompt / group + completion) / (prompt + completion) if shared else 1.0, rows=rows, layers=shape.layers, prompt=prompt, completion=completion,
                          iterations=int(getattr(policy, "num_iterations", 1) or 1), forwards=forwards,
                          trained=int(trained), adamw_per_param=adamw,
                          **{k: tuple(v) for k, v in out.items()})
    finally:
        torch.set_num_threads(saved)


CHOICE_ENV = "MRL_PLACEMENT_BY_COST"
"""The placement the launching rank runs under ``cost``, as JSON ``{"world": W, "mode": ..., "groups": {policy:
[ranks]}}``, written whatever decided it (a fallback included), for the workers it starts: every rank runs the one
calibration's choice, never its own; a worker refuses one of another world or other policies."""


def _placement_of(mode: str, ranks: dict[str, int], world_size: int):
    from mrl_lightning.mwra.placement import build_placement

    return build_placement(mode, ranks if mode == "disjoint" else None, list(ranks), world_size)


def place_by_cost(trainer, placement, policies: dict, shapes: dict, batch_size: int,
                  checkpoint: dict | None) -> tuple[object, str]:
    """``trainer.placement: cost``: the placement to run and the plan's lines about it (docs/mwra.md, "Placement by
    cost"). Any other ``trainer.placement`` is returned as it is, with no lines.

    A timed choice could differ between two runs of one config (two placements differ in their float rounding), so
    it is asked for by name, never made by ``auto``, and the plan prints the flags that pin it. In order:

    1. one rank or one policy: nothing to choose (the count rule's placement);
    2. a resumed run keeps the placement its checkpoint was written under, so it computes what the uninterrupted
       run did;
    3. a worker started by ``mrl`` takes the choice its launching rank made (:data:`CHOICE_ENV`), and refuses one
       of another world size or other policies;
    4. ranks started outside ``mrl`` (torchrun, SLURM, several nodes) keep the count rule, saying so: each would
       calibrate on its own and could choose differently;
    5. else this process (rank 0, before it starts the workers) calibrates every policy (:func:`calibrate`, at a
       worker's threads, and on a CPU also at every core's for the one-process line) and runs :func:`choose`'s
       first, among the placements the run's sharding checks accept. A calibration that fails, or no placement
       that passes, keeps the count rule and says why in one line.

    Raises:
        ConfigError: a worker without its launching rank's choice (step 3).
    """
    import json
    import os
    import time as clock

    import torch

    from mrl_lightning.errors import ConfigError
    from mrl_lightning.lifeline import is_launched_worker
    from mrl_lightning.mwra.placement import Placement

    world = placement.world_size
    if trainer.placement_mode != "cost":
        return placement, ""

    def handed(chosen, text: str):  # what this rank runs, and what the workers it starts will run (never a stale one)
        if not is_launched_worker():
            os.environ[CHOICE_ENV] = json.dumps({"world": world, "mode": chosen.mode,
                                                 "groups": {k: list(v) for k, v in chosen.groups.items()}})
        return chosen, text

    if world == 1 or len(policies) == 1:
        return handed(placement, f"\nplacement cost: {placement.mode} (one rank or one policy: nothing to choose)")
    saved = (checkpoint or {}).get("placement") or {}
    groups = {k: tuple(v) for k, v in (saved.get("groups") or {}).items()}
    if groups and set(groups) == set(policies) and max(r for g in groups.values() for r in g) + 1 == world:
        kept = Placement(saved["mode"], {name: groups[name] for name in policies}, world)
        return handed(kept, f"\nplacement cost: {kept.mode}, the placement the checkpoint resumed was written under")
    if is_launched_worker():
        choice = json.loads(os.environ.get(CHOICE_ENV) or "{}")
        if choice.get("world") != world or set(choice.get("groups") or {}) != set(policies):
            raise ConfigError(f"trainer.placement: cost: this worker found no placement from rank 0 for {world} ranks "
                              f"and policies {list(policies)} ({CHOICE_ENV}={os.environ.get(CHOICE_ENV)!r}); start "
                              "the run with mrl fit, or pin trainer.placement and trainer.policy_ranks.")
        return Placement(choice["mode"], {name: tuple(choice["groups"][name]) for name in policies}, world), ""
    env = getattr(trainer.fabric.strategy, "cluster_environment", None)
    if getattr(env, "creates_processes_externally", False) or getattr(trainer, "num_nodes", 1) > 1:
        return placement, (f"\nplacement cost: {placement.mode} by the rank count (ranks started outside mrl cannot "
                           "share one calibration; pin trainer.placement and trainer.policy_ranks)")
    from mrl_lightning.mwra.process import available_cores, omp_threads
    from mrl_lightning.mwra.sharding import sharding_errors

    device = trainer.fabric.device.type
    cores = available_cores()
    threads = trainer.num_threads or omp_threads() or max(1, cores // trainer.devices_per_node)  # as the plan's
    allowed = lambda mode, ranks: not sharding_errors(_placement_of(mode, ranks, world), policies,  # noqa: E731
                                                      batch_size)
    start, alone, saved_threads = clock.perf_counter(), None, torch.get_num_threads()
    try:
        costs = {name: calibrate(name, policies[name], shapes[name], batch_size, device, trainer.precision,
                                 threads if device == "cpu" else None) for name in policies}
        found = choose(costs, policies, batch_size, world, device, allowed)
        if device == "cpu" and cores > threads:
            wide = {name: calibrate(name, policies[name], shapes[name], batch_size, device, trainer.precision, cores)
                    for name in policies}
            alone = predict(wide, policies, batch_size, {name: 1 for name in policies}, "one process", device)
    except Exception as exc:  # noqa: BLE001 - a prediction must never stop a run that can run
        return handed(placement, f"\nplacement cost: {placement.mode} by the rank count (the calibration failed: "
                                 f"{type(exc).__name__}: {exc})")
    finally:
        torch.set_num_threads(saved_threads)
    if not found:  # no placement passes the checks: the count rule's, which the plan then reports
        return handed(placement, f"\nplacement cost: {placement.mode} by the rank count (no placement of {world} "
                                 "ranks passes the plan's checks)")
    best = found[0]
    pin = f"--trainer.placement {best.mode}" + (
        f" --trainer.policy_ranks '{json.dumps(best.ranks)}'" if best.mode == "disjoint" else "")
    lines = [f"placement cost: {best.mode}, the shortest predicted step (calibrated in "
             f"{clock.perf_counter() - start:.1f} s, {threads} thread(s) a worker; completions at "
             f"max_completion_length: upper bounds); to pin it: {pin}"]
    lines += [("  * " if p is best else "    ") + p.line() for p in found]
    if alone is not None:
        lines.append(f"    for comparison, {alone.line().replace('one process', f'one process on {cores} threads', 1)}"
                     " (--trainer.devices 1)")
    return handed(_placement_of(best.mode, best.ranks, world), "\n" + "\n".join(lines))
