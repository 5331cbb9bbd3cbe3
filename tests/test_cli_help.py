"""``mrl --help`` and friends: one usage block, no heavy import, every ``fit`` option listed.

Start-up contract (docs/README.md, "The command line"): ``mrl --help`` and the ``--help`` of
``mrl thl`` / ``mrl bandit`` import neither Lightning nor torch; only ``mrl fit`` imports Lightning.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

HEAVY = ("lightning", "torch", "transformers", "matplotlib")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _modules_after(argv: list[str]) -> tuple[int, str, list[str]]:
    """Exit status, stdout and the heavy modules loaded by ``mrl <argv>`` in a fresh interpreter."""
    code = (
        "import contextlib, io, json, sys\n"
        "from mrl_lightning.cli import main\n"
        "out = io.StringIO()\n"
        "try:\n"
        "    with contextlib.redirect_stdout(out):\n"
        f"        rc = main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    rc = exc.code\n"
        f"print(json.dumps([rc, out.getvalue(), [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    import json

    rc, text, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return rc, text, heavy


def test_mrl_help_prints_one_usage_block_and_imports_nothing_heavy():
    rc, text, heavy = _modules_after(["--help"])
    assert rc == 0
    assert text.count("usage:") == 1, text
    for sub in ("mrl fit", "mrl thl", "mrl bandit"):
        assert sub in text
    assert "Lightning Trainer command line tool" not in text
    assert heavy == [], f"mrl --help imported {heavy}"


def test_mrl_without_arguments_prints_the_usage_to_stderr_and_fails(capsys):
    from mrl_lightning.cli import main

    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("usage:") == 1


@pytest.mark.parametrize("sub", ["thl", "bandit"])
def test_sub_program_help_imports_neither_lightning_nor_torch(sub):
    rc, text, heavy = _modules_after([sub, "--help"])
    assert rc == 0
    assert text.count("usage:") == 1, text
    assert heavy == [], f"mrl {sub} --help imported {heavy}"
    for stale in ("SPEC", "issue 3", "FIELD_NOTES"):
        assert stale not in text


def test_fit_help_lists_every_trainer_option_in_one_usage_block():
    from mrl_lightning.loop.trainer import MRLTrainer  # what the help must cover

    proc = subprocess.run([sys.executable, "-m", "mrl_lightning.cli", "fit", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.count("usage:") == 1
    params = [p for p in inspect.signature(MRLTrainer.__init__).parameters if p != "self"]
    assert params, "MRLTrainer.__init__ has no options?"
    missing = [p for p in params if f"--trainer.{p}" not in text]
    assert not missing, f"mrl fit --help does not list {missing}"
    for option in ("--config", "--print_config", "--ckpt_path", "--model.policies", "--data", "--seed_everything"):
        assert option in text
    assert "SPEC" not in text
    # plain text, no docstring markup; --ckpt_path says what it does
    assert "``" not in text and ":class:" not in text and ":func:" not in text
    ckpt = text[text.index("  --ckpt_path CKPT_PATH"):]
    assert "resume" in ckpt.split("(type:")[0]


def test_help_markup_is_removed_and_other_backquotes_kept():
    from mrl_lightning.config.keys import plain_help

    text = "Trainer for :class:`~mrl_lightning.loop.system.MutualRL` (``--trainer.*``); see :func:`a.b.load`."
    assert plain_help(text) == "Trainer for MutualRL (--trainer.*); see a.b.load."
    for kept in ("default: ^\\d+`$", "a fence ```python``` in a template", "C:\\runs\\x", "{a: `b`}"):
        assert plain_help(kept) == kept


def test_a_reference_is_cleaned_before_the_help_is_wrapped():
    """A reference near the end of a line was split by the wrap when cleaned afterwards."""
    from mrl_lightning.config.keys import MRLArgumentParser

    parser = MRLArgumentParser(prog="x")
    parser.add_argument("--opt", help="word " * 8 + "uses :class:`~mrl_lightning.mwra.strategy.PolicyGroupsStrategy` "
                        "for it (``x``).")
    text = parser.format_help()
    assert "PolicyGroupsStrategy" in text
    assert "~" not in text and "mrl_lightning.mwra" not in text and "`" not in text and ":class:" not in text


def test_every_option_of_every_config_class_has_a_description_in_its_help():
    """``mrl fit --model.policies.help PolicyModule`` printed no description for any option once: a ``"\\n"``
    written unescaped in the class docstring put a line break at column 0 inside ``Args:``, and the
    docstring parser (the source of jsonargparse's help texts) read no argument at all."""
    from jsonargparse import ArgumentParser

    from mrl_lightning.config.keys import valid_classes
    from mrl_lightning.model.source import ModelRecipe  # noqa: F401 - the recipes' base, imported for its fields
    from mrl_lightning.loop.system import MutualRL
    from mrl_lightning.loop.trainer import MRLTrainer

    classes = [MRLTrainer, MutualRL]
    for path in valid_classes("every field"):
        module, _, name = path.rpartition(".")
        classes.append(getattr(__import__(module, fromlist=[name]), name))
    empty = {}
    for cls in classes:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, "x", fail_untyped=False, sub_configs=True)
        missing = [a.dest for a in parser._actions if a.dest.startswith("x.") and not a.dest.endswith(".help")
                   and a.dest.count(".") == 1 and not (a.help or "").strip()]
        if missing:
            empty[cls.__name__] = missing
    assert "PolicyModule" in {c.__name__ for c in classes}
    assert not empty, f"options without a description in --help: {empty}"
