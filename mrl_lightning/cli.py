"""The ``mrl`` command.

``mrl fit --config configs/default.yaml [--config callbacks/sgt.yaml] [--trainer.max_steps N]``
runs training through LightningCLI (:class:`mrl_lightning.commands.fit.MRLCLI`); ``mrl fit
--help`` lists every option. ``mrl replay`` (the same CLI) trains a run's policy again against its peers'
records in the run's exchange log (:mod:`mrl_lightning.loop.replay`). ``mrl thl ...`` (THL alignment report, ``docs/thl.md``) and
``mrl bandit ...`` (contextual-bandit analysis, ``docs/bandit.md``) and ``mrl export ...`` (a
trained policy as a ``save_pretrained`` folder, :mod:`mrl_lightning.commands.export`) are plain sub-programs.

Start-up: this module imports nothing heavy. Lightning, torch and the models are imported
only by the sub-command that needs them, so ``mrl --help`` answers at once and ``mrl thl``
/ ``mrl bandit`` never import Lightning. A worker process of a multi-worker run (``mrl``
started again by the first one) ties itself to its launcher before anything else
(:mod:`mrl_lightning.lifeline`).
"""

from __future__ import annotations

import os
import sys

from mrl_lightning.lifeline import INTERRUPTED_AT_START, is_launched_worker, tie_to_launcher

USAGE = """usage: mrl {fit,replay,export,thl,bandit} ...

  mrl fit --config configs/default.yaml [--config callbacks/sgt.yaml] [--trainer.max_steps N] ...
        train the policies (LightningCLI; `mrl fit --help` lists every option)
  mrl replay --config RUN/config.yaml --exchange_log RUN/exchange.jsonl --policies NAME
        train one policy again, its peers' records read from the run's exchange log (docs/see.md, "Replay")
  mrl export --run runs/default/version_0 --policy gpt2 --out DIR
        a trained policy (LoRA merged) as a save_pretrained folder (`mrl export --help`)
  mrl thl --source TOKENIZER --target TOKENIZER [--text-file FILE]
        THL alignment report between two tokenizers (`mrl thl --help`)
  mrl bandit --out DIR
        contextual-bandit analysis of the probes (`mrl bandit --help`)

Documentation: docs/README.md
"""
COMMANDS = ("fit", "replay", "export", "thl", "bandit")


def __getattr__(name: str):
    """``mrl_lightning.cli.MRLCLI``, imported on first use (it pulls in Lightning)."""
    if name == "MRLCLI":
        from mrl_lightning.commands.fit import MRLCLI

        return MRLCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mrl``.

    Args:
        argv: Arguments after ``mrl`` (``None`` = ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success (``mrl --help`` included), 2 on a configuration error,
        a full disk (:func:`mrl_lightning.run.stop.disk_full_line`) or no sub-command (the usage
        then goes to stderr), 1 on any other error, 130 when
        interrupted (Ctrl-C), 3 in a worker that stopped because a peer failed
        (:mod:`mrl_lightning.run.stop`).
    """
    tie_to_launcher()  # a worker process dies with the `mrl` process that started it (mrl_lightning.lifeline)
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and not all(n.strip().isdigit() and int(n) > 0 for n in threads.split(",")):  # libgomp
        print(f"mrl: configuration error: OMP_NUM_THREADS={threads!r} must be a positive integer (or unset); e.g. "
              "OMP_NUM_THREADS=1, or unset OMP_NUM_THREADS (mrl fit sets torch's threads from trainer.num_threads).",
              file=sys.stderr, flush=True)
        return 2
    if os.environ.get("MRL_CACHE_DIR") is not None and not os.environ["MRL_CACHE_DIR"].strip():
        print(f"mrl: configuration error: MRL_CACHE_DIR={os.environ['MRL_CACHE_DIR']!r} is empty: the model cache would "
              "be made in the current "
              "folder. Unset it (the cache is then ~/.cache/mrl_lightning) or give a folder: MRL_CACHE_DIR=<folder>.",
              file=sys.stderr, flush=True)
        return 2
    if argv and argv[0] == "thl":
        from mrl_lightning.model.hub import hub_load_kwargs
        from mrl_lightning.thl.cli import main as thl_main

        return thl_main(argv[1:], hub_kwargs=lambda spec, option: hub_load_kwargs(
            spec, option, "tokenizer spec", filename="tokenizer_config.json"))
    if argv and argv[0] == "export":
        from mrl_lightning.commands.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "bandit":
        from mrl_lightning.analysis.cli import main as bandit_main

        return bandit_main(argv[1:])
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:  # LightningCLI: "(choose from 'fit')"
        import difflib

        near = difflib.get_close_matches(argv[0], COMMANDS, n=1, cutoff=0.6)
        print(f"mrl: unknown command {argv[0]!r}" + (f"; did you mean {near[0]!r}?" if near else ".")
              + f" Commands: {', '.join(COMMANDS)} (mrl <command> --help).", file=sys.stderr, flush=True)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    # Before torch is imported (it reads this once): a CPU tensor of 2 MiB or more gets transparent huge
    # pages, so a fresh large gradient (a real model's [V, h] head) is not faulted in 4 KiB pages, ten
    # times slower than writing the same bytes again (docs/speed.md, "Large fresh tensors"). A value the
    # user set is kept; 0 turns it off.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    MRLCLI = _import_fit_cli()
    if MRLCLI is None:  # Ctrl-C while torch and Lightning were imported
        if not is_launched_worker():  # a launched worker ends quietly: its launcher had the same Ctrl-C
            print(INTERRUPTED_AT_START, flush=True)
        return 130
    try:
        MRLCLI(args=None if from_shell else argv)
    except SystemExit:
        raise  # the parser's own exits: --help, --print_config, a refused option (status 2)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - each kind gets its one message
        return _stopped(exc)
    return 0


def _import_fit_cli():
    """``MRLCLI``, imported with Ctrl-C held until the import is done; None when Ctrl-C came meanwhile.

    A KeyboardInterrupt raised inside torch's or Lightning's import leaves half-initialized
    modules behind (``partially initialized module 'torch' has no attribute 'cuda'``), or
    surfaces inside a C extension's set-up as another error (``generic_type: cannot
    initialize type "RpcBackendOptions"``): neither can print the one-line hint. So SIGINT is
    only noted while the import runs (the first seconds of every ``mrl fit`` and of each of
    its workers) and acted on once it is done.
    """
    import signal
    import threading

    noted: list[int] = []
    previous = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        from mrl_lightning.commands.fit import MRLCLI
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return None if noted else MRLCLI


def _stopped(exc: BaseException) -> int:
    """Print this process's one message about ``exc`` (or nothing: another rank speaks); the exit status."""
    from mrl_lightning.run.stop import StopContext, config_error_in, config_error_text, stop_run

    if config_error_in(exc) is None and _from_config_parsing(exc):
        from mrl_lightning.config.reports import union_cause

        # jsonargparse folds nested ConfigErrors into a Union message: the class's own error, one line a cause
        print(config_error_text(union_cause(str(exc)) or exc), file=sys.stderr, flush=True)
        return 2
    context = getattr(exc, "mrl_stop", None)  # set by MRLTrainer.fit: rank, workers, the interrupted line
    if context is None:  # before the run: parsing, building the config's classes
        context = StopContext(rank=int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0),
                              world_size=int(os.environ.get("WORLD_SIZE") or 1), launched_worker=is_launched_worker(),
                              interrupted_line=lambda: INTERRUPTED_AT_START)
    return stop_run(exc, context)


def _from_config_parsing(exc: BaseException) -> bool:
    """True for jsonargparse's "does not validate" errors raised while instantiating the config."""
    return isinstance(exc, ValueError) and "Does not validate against any of the Union subtypes" in str(exc)


if __name__ == "__main__":
    sys.exit(main())
