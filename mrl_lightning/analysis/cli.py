"""``mrl bandit``: the contextual-bandit analysis (docs/bandit.md) from the command line.

Usage::

    mrl bandit --out DIR [--seed S] [--steps T] [--contexts N] [--actions K]
               [--group-size G] [--residual p] [...]
    python -m mrl_lightning.analysis.cli --out DIR ...

Writes ``bandit_results.json``, ``bandit_probes.csv``, ``bandit_curves.csv``,
``stability_support.png`` and ``success_over_training.png`` into ``DIR`` (see
:mod:`mrl_lightning.analysis.report`), prints a summary table and the paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from mrl_lightning.analysis.config import PROBES_BY_NAME, BanditConfig

_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(BanditConfig)}

# (flag, config field, type, help); defaults come from BanditConfig.
_OPTIONS = (
    ("--seed", "seed", int, "seed of the problem and every random stream"),
    ("--steps", "steps", int, "T, SGD steps of training per probe"),
    ("--contexts", "num_contexts", int, "N contexts (even: two halves)"),
    ("--actions", "num_actions", int, "K actions"),
    ("--correct-per-context", "correct_per_context", int, "correct actions per context"),
    ("--group-size", "group_size", int, "G own samples per context and step"),
    ("--peer-samples", "peer_samples", int, "M peer samples PRP pools / SGT screens (<= G)"),
    ("--residual", "residual", float, "THL residual: probability a transferred action arrives corrupted"),
    ("--strong-prob", "strong_prob", float, "initial mass on correct actions, strong half"),
    ("--weak-prob", "weak_prob", float, "initial mass on correct actions, weak half"),
    ("--logit-noise", "logit_noise", float, "std of within-set logit noise of the initial policies"),
    ("--lr", "lr", float, "SGD step size on the logits"),
    ("--replicas", "replicas", int, "independent training runs per probe (curves are their mean)"),
    ("--mc-draws", "mc_draws", int, "Monte-Carlo draws per update measurement"),
    ("--checkpoints", "checkpoints", int, "measurement points along training, step 0 included"),
    ("--is-cap", "is_cap", float, "PRP weight cap c (truncate min(rho,c), clip [1/c,c])"),
    ("--lambda-prp", "lambda_prp", float, "PRP peer loss weight"),
    ("--alpha", "alpha", float, "XGRPO baseline mixing weight"),
    ("--scale-source", "scale_source", str, "XGRPO scale: union or own"),
    ("--lambda-sgt", "lambda_sgt", float, "SGT transfer weight of the 'sgt' arm"),
    ("--sgt-max-demos", "sgt_max_demos", int, "m, SGT demos per rescued context"),
    ("--kappa", "kappa", float, "SGT own success-rate gate"),
    ("--support-threshold", "support_threshold", float, "weak-context support that counts as reached"),
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mrl bandit``.

    Returns:
        An :class:`argparse.ArgumentParser`; ``--out`` is required.
    """
    parser = argparse.ArgumentParser(
        prog="mrl bandit",
        description="Contextual-bandit analysis of the probes: stability-support plane and success over "
        "training (docs/bandit.md).",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    for flag, field, typ, text in _OPTIONS:
        parser.add_argument(flag, dest=field, type=typ, default=_DEFAULTS[field],
                            help=f"{text} (default: {_DEFAULTS[field]})")
    parser.add_argument("--probes", nargs="+", default=list(_DEFAULTS["probes"]),
                        help=f"arms to run, from {list(PROBES_BY_NAME)} (default: all)")
    parser.add_argument("--sgt-extra-lambdas", dest="sgt_extra_lambdas", nargs="*", type=float,
                        default=list(_DEFAULTS["sgt_extra_lambdas"]),
                        help="extra SGT arms, one per weight, named sgt@<lambda> "
                        f"(default: {list(_DEFAULTS['sgt_extra_lambdas'])}; none: give the flag alone)")
    parser.add_argument("--quiet", action="store_true", help="print only the output paths")
    return parser


def config_from_args(args: argparse.Namespace) -> BanditConfig:
    """Builds the validated config from parsed arguments.

    Args:
        args: Namespace from :func:`build_parser`.

    Returns:
        The :class:`BanditConfig`.

    Raises:
        ValueError: invalid settings (one message listing all of them).
    """
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(BanditConfig)}
    values["probes"] = tuple(values["probes"])
    values["sgt_extra_lambdas"] = tuple(values["sgt_extra_lambdas"])
    return BanditConfig(**values)


def main(argv: list[str] | None = None) -> int:
    """Runs ``mrl bandit``.

    Args:
        argv: Arguments after ``bandit`` (``None`` = ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on invalid settings (the message goes to stderr).

    Raises:
        SystemExit: from argparse on unknown flags or ``--help``.
        OSError: the output directory cannot be written.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        print(f"mrl bandit: error: {err}", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"mrl bandit: error: --out {args.out} is a file; give a folder (created if missing).", file=sys.stderr)
        return 2
    try:  # before the work: a folder that cannot be made or written fails here, not after the analysis
        os.makedirs(args.out, exist_ok=True)
        problem = None if os.access(args.out, os.W_OK) else "not writable"
    except OSError as err:
        problem = f"cannot be created ({err.strerror})"
    if problem:
        print(f"mrl bandit: error: --out {args.out} {problem}; give a folder this user can write.", file=sys.stderr)
        return 2
    from mrl_lightning.analysis.report import summary_table, write_results  # matplotlib: only when run
    from mrl_lightning.analysis.simulate import run_analysis

    start = time.perf_counter()
    results = run_analysis(cfg)
    results["runtime_s"] = round(time.perf_counter() - start, 2)
    paths = write_results(results, args.out)
    if not args.quiet:
        print(summary_table(results))
        print(f"\nvar_* and noise/sig are per context at step 0; supp_* is weak-context support "
              f"after {cfg.steps} steps; t_supp = steps until both families pass "
              f"{cfg.support_threshold}. Runtime {results['runtime_s']} s.")
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
