"""Config keys the CLI does not know: refused whole, with the nearest valid key named.

Three gaps of the plain LightningCLI / jsonargparse parser, closed here:

- Abbreviations. argparse accepts any unambiguous prefix of an option (``allow_abbrev``,
  on by default, and jsonargparse keeps it until its 5.0), so ``--trainer.max_step 3``
  silently set ``trainer.max_steps``. ``mrl fit`` builds its parsers with
  ``allow_abbrev=False`` (``parser_kwargs`` of the main parser, which its subcommand
  parsers copy): a prefix is an unknown option like any other.
- Unknown keys. jsonargparse says ``Subcommand 'fit' does not accept option
  'trainer.max_step'`` or ``Option 'learning_rat' is not accepted`` and stops there.
  :class:`MRLArgumentParser` adds the nearest valid keys (``difflib``), for top-level
  dotted keys, command-line options and the ``init_args`` of any ``class_path``.
- Empty config files. An empty YAML file (or one of comments only) loads as nothing and
  jsonargparse answers ``Unexpected config:`` with nothing after it; the file is named
  instead, and so is a file whose top level is not a mapping.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from pathlib import Path

import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser

_TOP_KEY = re.compile(r"does not accept option '([^']+)'")
_CLASS_KEY = re.compile(r"class_path '([\w.]+)':\s*\n\s*Option '([^']+)' is not accepted")
_BARE_KEY = re.compile(r"^Option '([^']+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def _close(word: str, valid: list[str]) -> list[str]:
    """The valid keys nearest to ``word``: by the last dotted part among keys of the same
    section (``trainer.max_step`` -> ``trainer.max_steps``), else by the whole key."""
    section, _, leaf = word.rpartition(".")
    siblings = {}
    if section:
        siblings = {v.rpartition(".")[2]: v for v in valid if "." in v and v.rpartition(".")[0] == section}
    if siblings:
        near = difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.6)
        if near:
            return [siblings[n] for n in near]
    return difflib.get_close_matches(word, valid, n=3, cutoff=0.6)


def init_arg_names(class_path: str) -> list[str]:
    """The ``__init__`` parameter names of a class given by its import path ([] if it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _option_keys(parser) -> list[str]:
    """Every dotted key (``trainer.max_steps``) of ``parser`` and of its subcommand parsers."""
    keys = []
    for action in parser._actions:
        if getattr(action, "dest", None) and action.dest not in ("help", "==SUPPRESS=="):
            keys.append(action.dest)
        for sub in (getattr(action, "_name_parser_map", None) or {}).values():
            keys.extend(_option_keys(sub))
    return sorted(set(keys))


def suggestions(message: str, parser) -> list[str]:
    """"Did you mean" lines for the unknown keys named in a jsonargparse error message."""
    lines = []
    keys = None
    for key in _TOP_KEY.findall(message):
        keys = keys or _option_keys(parser)
        near = _close(key, keys)
        lines.append(f"'{key}' is not a config key" + (f"; did you mean {' or '.join(map(repr, near))}?" if near
                                                         else "; `mrl fit --help` lists the valid ones."))
    for class_path, key in _CLASS_KEY.findall(message):
        valid = init_arg_names(class_path)
        near = _close(key, valid)
        hint = f"did you mean {' or '.join(map(repr, near))}?" if near else f"valid: {valid}."
        lines.append(f"{class_path.rsplit('.', 1)[-1]} has no argument '{key}'; {hint}")
    for tail in _UNRECOGNIZED.findall(message):
        options = None
        for token in tail.split():
            if not token.startswith("--"):
                continue
            options = options or ["--" + k for k in _option_keys(parser)]
            word = token.split("=", 1)[0].rstrip("+")
            near = _close(word, options)
            prefix_of = [o for o in options if o.startswith(word) and o != word]
            if prefix_of:
                lines.append(f"{word} is not an option; options are never abbreviated: write {prefix_of[0]}.")
            elif near:
                lines.append(f"{word} is not an option; did you mean {' or '.join(near)}?")
    return lines


def config_file_problems(args: list[str]) -> list[str]:
    """Problems of the ``--config`` files named in ``args`` that jsonargparse reports without naming them.

    Returns:
        One message per config file that is empty (or comments only), or whose top level
        is not a mapping of keys. Files that are missing or not YAML are left to the parser.
    """
    paths = []
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            paths.append(args[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    problems = []
    for path in paths:
        file = Path(path)
        if not file.is_file():
            continue
        try:
            data = yaml.safe_load(file.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            tab = " (YAML does not allow tabs for indentation: use spaces)" if "'\\t'" in problem else ""
            problems.append(f"config file {path!r} is not valid YAML{where}: {problem}{tab}.")
            continue
        except UnicodeDecodeError:
            problems.append(f"config file {path!r} is not UTF-8 text.")
            continue
        if data is None:
            problems.append(f"config file {path!r} is empty (or holds only comments): give a YAML mapping such as "
                            "'trainer: {max_steps: 10}', or leave the file out.")
        elif not isinstance(data, dict):
            problems.append(f"config file {path!r} holds a YAML {type(data).__name__}, not a mapping of keys "
                            "(trainer:, model:, data:, ...).")
    return problems


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(~?)\s*([^`]+?)\s*`")
_LITERAL = re.compile(r"(?<!`)``([^`]+)``(?!`)")


def plain_help(text: str) -> str:
    """One help string with the docstrings' reStructuredText markup removed.

    ``--help`` shows the ``Args:`` sections of the classes it configures; their cross
    references and literals read as code in the docs but as noise on a terminal:
    ``:class:`~mrl_lightning.system.MutualRL``` -> ``MutualRL`` (``~``: the last name only),
    ``:func:`a.b``` -> ``a.b``, ````max_steps```` -> ``max_steps``. Any other backquote is
    kept. Applied to each help string before it is wrapped (:class:`PlainHelpFormatter`),
    so a reference is never split over two lines.
    """
    text = _ROLE.sub(lambda m: m.group(2).rpartition(".")[2] if m.group(1) else m.group(2), text)
    return _LITERAL.sub(r"\1", text)


class PlainHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, with :func:`plain_help` applied to every text before wrapping."""

    def _split_lines(self, text, width):
        return super()._split_lines(plain_help(text), width)

    def _fill_text(self, text, width, indent):
        return super()._fill_text(plain_help(text), width, indent)

    def start_section(self, heading):
        super().start_section(plain_help(heading) if heading else heading)


class MRLArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, naming the nearest valid key after an unknown one (module docstring),
    with docstring markup removed from ``--help`` (:class:`PlainHelpFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, *pos, **kwargs):
        problems = config_file_problems(list(sys.argv[1:] if args is None else args))
        if problems:
            self.error("\n".join(problems))
        return super().parse_args(args, *pos, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        """The error, the nearest valid key and jsonargparse's ``--help`` tip, without the 30-line usage
        block that would bury them (status 2)."""
        if not self.exit_on_error:  # a nested parser's attempt, not the final report
            return super().error(message, ex)
        hints = suggestions(message, self)
        if hints:
            message = message.rstrip() + "\n" + "\n".join(hints)
        _quiet_usage[0] = True
        try:
            return super().error(message, ex)
        finally:
            _quiet_usage[0] = False

    def print_usage(self, file=None):
        if not _quiet_usage[0]:
            super().print_usage(file)


_quiet_usage = [False]  # set while an error is reported: the parser that reports it prints no usage
