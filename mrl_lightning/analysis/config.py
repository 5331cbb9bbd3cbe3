"""Settings of the contextual-bandit analysis (docs/bandit.md) and the probes it compares.

One frozen dataclass, validated at construction and reporting every problem at once, so
that a bad command line fails before any simulation starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mrl_lightning.analysis.updates import IS_MODES

PROBE_KINDS = ("none", "prp", "xgrpo", "sgt")


@dataclass(frozen=True)
class ProbeSpec:
    """One arm of the comparison.

    Attributes:
        name: Label in tables and figures, e.g. ``"prp-clip"``.
        kind: ``"none"``, ``"prp"``, ``"xgrpo"`` or ``"sgt"`` (docs/probes.md).
        is_mode: PRP weight mode (``"truncate"``, ``"clip"``, ``"none"``); ``None`` otherwise.
        lambda_sgt: SGT transfer weight overriding ``BanditConfig.lambda_sgt`` (extra SGT
            points on the plane); ``None`` = use the config's.
    """

    name: str
    kind: str
    is_mode: str | None = None
    lambda_sgt: float | None = None

    def __post_init__(self) -> None:
        """Checks the kind and the PRP weight mode.

        Raises:
            ValueError: unknown ``kind``, a PRP spec without a valid ``is_mode``, or an
                ``is_mode`` on a non-PRP probe.
        """
        if self.kind not in PROBE_KINDS:
            raise ValueError(f"ProbeSpec kind={self.kind!r} is unknown; valid: {list(PROBE_KINDS)}")
        if self.kind == "prp" and self.is_mode not in IS_MODES:
            raise ValueError(
                f"ProbeSpec {self.name!r}: is_mode={self.is_mode!r} is unknown; valid: {sorted(IS_MODES)}"
            )
        if self.kind != "prp" and self.is_mode is not None:
            raise ValueError(f"ProbeSpec {self.name!r}: is_mode applies to PRP only; drop it")
        if self.lambda_sgt is not None and (self.kind != "sgt" or self.lambda_sgt < 0):
            raise ValueError(
                f"ProbeSpec {self.name!r}: lambda_sgt={self.lambda_sgt} needs kind='sgt' and a value >= 0"
            )


ALL_PROBES: tuple[ProbeSpec, ...] = (
    ProbeSpec("none", "none"),
    ProbeSpec("prp-truncate", "prp", "truncate"),
    ProbeSpec("prp-clip", "prp", "clip"),
    ProbeSpec("prp-none", "prp", "none"),
    ProbeSpec("xgrpo", "xgrpo"),
    ProbeSpec("sgt", "sgt"),
)
PROBES_BY_NAME = {p.name: p for p in ALL_PROBES}


@dataclass(frozen=True)
class BanditConfig:
    """Everything that determines a run; the same config and seed give the same numbers.

    Attributes:
        seed: Seed of the problem and of every random stream.
        num_contexts: ``N`` contexts (even: two halves).
        num_actions: ``K`` actions.
        correct_per_context: Correct actions per context (reward 1).
        group_size: ``G`` own samples per context and step.
        peer_samples: ``M`` peer samples per context PRP pools and SGT screens (<= G: the
            first ``M`` of the peer's own group).
        strong_prob: Initial mass on correct actions in a family's strong half.
        weak_prob: Initial mass on correct actions in its weak half ("near zero").
        logit_noise: Std of the within-set logit noise of the initial policies.
        residual: THL residual, probability a transferred action arrives corrupted.
        steps: ``T`` SGD steps of training per probe.
        lr: SGD step size on the logits (per context).
        replicas: Independent training runs per probe, averaged in the curves.
        mc_draws: Monte-Carlo draws per measurement of the update's mean and variance.
        checkpoints: Points along training (including step 0) where the update is measured.
        is_cap: ``c`` of PRP's weight modes.
        lambda_prp: PRP peer loss weight.
        alpha: XGRPO baseline mixing weight.
        scale_source: XGRPO scale, ``"union"`` or ``"own"``.
        lambda_sgt: SGT transfer weight of the ``"sgt"`` arm.
        sgt_extra_lambdas: More SGT arms, one per weight, named ``"sgt@<lambda>"``: the
            raw variance scales with ``lambda_sgt ** 2``, so one weight alone can mislead.
        sgt_max_demos: ``m``, SGT demos per rescued context.
        kappa: SGT own success-rate gate.
        support_threshold: Weak-context support a probe must reach (both families) to
            "reach support".
        probes: Arms to run, names from ``ALL_PROBES``.
    """

    seed: int = 0
    num_contexts: int = 64
    num_actions: int = 16
    correct_per_context: int = 1
    group_size: int = 8
    peer_samples: int = 8
    strong_prob: float = 0.9
    weak_prob: float = 1e-3
    logit_noise: float = 1.0
    residual: float = 0.1
    steps: int = 200
    lr: float = 1.0
    replicas: int = 8
    mc_draws: int = 2000
    checkpoints: int = 3
    is_cap: float = 2.0
    lambda_prp: float = 1.0
    alpha: float = 0.5
    scale_source: str = "union"
    lambda_sgt: float = 0.1
    sgt_extra_lambdas: tuple[float, ...] = (0.5,)
    sgt_max_demos: int = 1
    kappa: float = 0.0
    support_threshold: float = 0.5
    probes: tuple[str, ...] = field(default_factory=lambda: tuple(PROBES_BY_NAME))

    def __post_init__(self) -> None:
        """Validates all fields together.

        Raises:
            ValueError: one message listing every invalid field, its value and the fix.
        """
        p = []

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                p.append(f"{name}={getattr(self, name)!r}: {rule}")

        need(self.num_contexts >= 2 and self.num_contexts % 2 == 0, "num_contexts", "use an even number >= 2")
        need(self.correct_per_context >= 1, "correct_per_context", "use >= 1")
        need(self.num_actions > self.correct_per_context, "num_actions", "use more than correct_per_context")
        need(self.group_size >= 2, "group_size", "use >= 2 (GRPO needs a group std)")
        need(1 <= self.peer_samples <= self.group_size, "peer_samples", "use 1..group_size")
        need(0.0 < self.strong_prob < 1.0, "strong_prob", "use a value in (0, 1)")
        need(0.0 < self.weak_prob < self.strong_prob, "weak_prob", "use a value in (0, strong_prob)")
        need(self.logit_noise >= 0.0, "logit_noise", "use >= 0")
        need(0.0 <= self.residual <= 1.0, "residual", "use a probability in [0, 1]")
        need(self.steps >= 1, "steps", "use >= 1")
        need(self.lr > 0.0, "lr", "use > 0")
        need(self.replicas >= 1, "replicas", "use >= 1")
        need(self.mc_draws >= 2, "mc_draws", "use >= 2 (a variance needs two draws)")
        need(1 <= self.checkpoints <= self.steps + 1, "checkpoints", "use 1..steps+1")
        need(self.is_cap > 1.0, "is_cap", "use c > 1")
        need(self.lambda_prp >= 0.0, "lambda_prp", "use >= 0")
        need(0.0 <= self.alpha <= 1.0, "alpha", "use a value in [0, 1]")
        need(self.scale_source in ("union", "own"), "scale_source", "use 'union' or 'own'")
        need(self.lambda_sgt >= 0.0, "lambda_sgt", "use >= 0")
        need(all(v >= 0.0 for v in self.sgt_extra_lambdas), "sgt_extra_lambdas", "use values >= 0")
        need(len({f"{v:g}" for v in self.sgt_extra_lambdas}) == len(self.sgt_extra_lambdas),
             "sgt_extra_lambdas", "list each weight once")
        need(self.sgt_max_demos >= 1, "sgt_max_demos", "use >= 1")
        need(0.0 <= self.kappa <= 1.0, "kappa", "use a value in [0, 1]")
        need(0.0 < self.support_threshold <= 1.0, "support_threshold", "use a value in (0, 1]")
        unknown = [n for n in self.probes if n not in PROBES_BY_NAME]
        need(not unknown and len(self.probes) > 0, "probes", f"choose from {list(PROBES_BY_NAME)}")
        need(len(set(self.probes)) == len(self.probes), "probes", "list each probe once")
        mem = self.mc_draws * 2 * self.num_contexts * self.num_actions * 8
        need(mem <= 2**30, "mc_draws", f"needs {mem / 2**30:.1f} GiB of updates; lower it below 1 GiB")
        if p:
            raise ValueError("invalid bandit settings: " + "; ".join(p))

    @property
    def probe_specs(self) -> tuple[ProbeSpec, ...]:
        """The selected :class:`ProbeSpec` objects in the order given, then the extra SGT arms."""
        extra = tuple(ProbeSpec(f"sgt@{v:g}", "sgt", lambda_sgt=float(v)) for v in self.sgt_extra_lambdas)
        return tuple(PROBES_BY_NAME[n] for n in self.probes) + extra
