"""Config keys the CLI does not know: refused whole, with the nearest valid key named.

Gaps of the plain LightningCLI / jsonargparse parser, closed here:

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
  instead, and so is a file whose top level is not a mapping, one that is not YAML and one
  that is not UTF-8 (the byte, its offset, line and column).
- Class paths that name no class. jsonargparse answers a misspelled ``class_path``
  (``mrl_lightning.callbacks.SuccesGatedTransfer``) with a 10-line dump of the union it
  tried, the cause on line 6. Each ``class_path`` of the ``--config`` files is imported
  before the parse (:func:`class_path_problem`; jsonargparse imports them anyway) and one
  that names no class is one line with the nearest valid classes of its field
  (:data:`CLASS_FIELDS`); one given on the command line gets the same line from the parser's
  error.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import io
import re
import sys
from pathlib import Path

import yaml
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningArgumentParser

from mrl_lightning.config.reports import CLASS_KEY as _CLASS_KEY
from mrl_lightning.config.reports import PARSER_KEY as _PARSER_KEY
from mrl_lightning.config.reports import TOP_KEY as _TOP_KEY
from mrl_lightning.config.reports import (config_file_naming, config_file_setting, config_folder_line, config_paths,
                                          duplicate_key_lines, error_key, missing_config_line, type_message)

_BARE_KEY = re.compile(r"^Option '([^']+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_CLASS_IMPORT = re.compile(r"Problem with given class_path '([\w.]+)':\s*\n\s*"
                           r"((?:module '[\w.]+' has no attribute|No module named) '[\w.]+')"
                           r"|Expected a dot import path string: (\w+)\s*$", re.M)

CLASS_FIELDS = {
    "trainer.callbacks": ("mrl_lightning.callbacks", "mrl_lightning.callbacks.base.MRLCallback"),
    "model.reward_funcs": ("mrl_lightning.rewards", "mrl_lightning.rewards.base.RewardFunction"),
    "model.policies": ("mrl_lightning.policy", "mrl_lightning.policy.PolicyModule"),
    "model.policies.model": ("mrl_lightning.recipes", "mrl_lightning.model.source.ModelRecipe"),
    "data": ("mrl_lightning.data", "mrl_lightning.data.stream.PromptDataModule"),
}
"""The ``class_path`` fields of a config, by key without list indices and ``init_args``: the
package whose classes are valid there (named in "did you mean") and their base class."""


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


def _accepts_any_keyword(class_path: str) -> bool:
    """True when the class's ``__init__`` takes ``**kwargs`` (any key is then its own business)."""
    module, _, name = class_path.rpartition(".")
    try:
        params = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return True
    return any(p.kind == p.VAR_KEYWORD for p in params)


def unknown_argument_line(class_path: str, key: str) -> str:
    """One line for an ``init_args`` key the class does not take: removed (why) or the nearest valid ones."""
    name = class_path.rsplit(".", 1)[-1]
    removed = REMOVED_ARGUMENTS.get((name, key))
    if removed is not None:
        return f"{name} has no argument '{key}': {removed}"
    valid = init_arg_names(class_path)
    near = _close(key, valid)
    hint = f"did you mean {' or '.join(map(repr, near))}?" if near else f"valid: {valid}."
    return f"{name} has no argument '{key}'; {hint}"


def init_arg_names(class_path: str) -> list[str]:
    """The ``__init__`` parameter names of a class given by its import path ([] if it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _resolve(path: str) -> tuple[object | None, str | None]:
    """``(object, None)`` for an import path that resolves, ``(None, why)`` for one that does not, ``(None, None)``
    when the import itself failed on something else (a missing dependency of the module: the parse names it)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module, the rest attributes
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            return None, None
        except Exception:  # noqa: BLE001 - a module that fails to import: the full parse reports it
            return None, None
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return None, f"module {name!r} has no attribute {attr!r}"
            obj, name = getattr(obj, attr), f"{name}.{attr}"
        return obj, None
    return None, f"no module named {parts[0]!r}"


def _subclasses(base: type) -> list[type]:
    out, todo = [], [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


def valid_classes(kind: str) -> list[str]:
    """Import paths of the classes valid at a ``class_path`` field (:data:`CLASS_FIELDS`; all of them for another
    field): the package's public classes of the field's base class, the base itself only where the field names it
    through the package (``mrl_lightning.policy.PolicyModule``)."""
    out = []
    for package, base_path in [CLASS_FIELDS[kind]] if kind in CLASS_FIELDS else list(CLASS_FIELDS.values()):
        module, base = importlib.import_module(package), _resolve(base_path)[0]
        for name in getattr(module, "__all__", None) or dir(module):
            obj = getattr(module, name, None)
            if inspect.isclass(obj) and issubclass(obj, base) and (obj is not base or base_path == f"{package}.{name}"):
                out.append(f"{package}.{name}")
    return sorted(set(out))


def class_path_problem(class_path: str, kind: str) -> str | None:
    """Why ``class_path`` names no class (``"module 'm' has no attribute 'X'"``); None when it does, or when only
    the full parse can tell (a name without a module at a field of no known base, a module failing to import)."""
    if "." not in class_path:  # jsonargparse takes a bare name of an imported subclass of the field's base
        if kind not in CLASS_FIELDS:
            return None
        package, base_path = CLASS_FIELDS[kind]
        importlib.import_module(package)  # its classes imported, as the parse will have them
        base = _resolve(base_path)[0]
        if class_path in {cls.__name__ for cls in _subclasses(base)} | {base.__name__}:
            return None
        return "no module given, and no imported class of this field has that name"
    return _resolve(class_path)[1]


def class_path_line(label: str, class_path: str, reason: str, kind: str) -> str:
    """One line: the field, the class path, why it names no class and the nearest valid classes of the field."""
    valid = valid_classes(kind)
    by_name = {path.rpartition(".")[2]: path for path in valid}
    name = class_path.rpartition(".")[2]
    near = [by_name[n] for n in difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.6)]
    near = near or difflib.get_close_matches(class_path, valid, n=3, cutoff=0.6)
    fix = (f"did you mean {' or '.join(map(repr, near))}?" if near
           else f"valid: {', '.join(valid)}, or the import path of a class of your own.")
    return f"{label}.class_path {class_path!r} names no class ({reason}); {fix}"


def _class_paths(node, label: str = "", kind: str = ""):
    """``(label, kind, class_path, init_args)`` of each ``class_path`` in a loaded config: label
    ``trainer.callbacks[1]``, kind ``trainer.callbacks`` (the :data:`CLASS_FIELDS` key: no list index, no
    ``init_args``)."""
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str) and label:
            yield label, kind, node["class_path"], node.get("init_args")
        for key, value in node.items():
            if key == "init_args":
                yield from _class_paths(value, f"{label}.init_args", kind)
            elif key != "class_path":
                yield from _class_paths(value, f"{label}.{key}" if label else str(key),
                                        f"{kind}.{key}" if kind else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _class_paths(value, f"{label}[{i}]", kind)


def _class_path_message(message: str) -> str | None:
    """jsonargparse's dump of a ``class_path`` that names no class (one given on the command line) as one line."""
    match = _CLASS_IMPORT.search(message)
    if match is None:
        return None
    kind = ".".join(_PARSER_KEY.findall(message[:match.start()]))
    class_path = match.group(1) or match.group(3)
    reason = match.group(2) or class_path_problem(class_path, kind) or "not an import path"
    return class_path_line(kind or "the", class_path, reason, kind)


def _class_key_message(message: str) -> str | None:
    """jsonargparse's report of an ``init_args`` key a class does not take (``--data.init_args.batchsize``) as one
    line: the field, the class, and the nearest valid keys (:func:`unknown_argument_line`); None for any other."""
    found = _CLASS_KEY.findall(message)
    keys = _PARSER_KEY.findall(message)
    if len(found) != 1 or not keys:
        return None
    return f"{keys[0]}.init_args: {unknown_argument_line(*found[0])}"


def _top_key_message(message: str, parser) -> str | None:
    """jsonargparse's report of one unknown key (``trainer.max_step``) as the one "did you mean" line; None for any
    other report."""
    found = _TOP_KEY.findall(message)
    return suggestions(message, parser)[0] if len(found) == 1 and not _UNRECOGNIZED.search(message) else None


def _option_keys(parser) -> list[str]:
    """Every dotted key (``trainer.max_steps``) of ``parser`` and of its subcommand parsers."""
    keys = []
    for action in parser._actions:
        if getattr(action, "dest", None) and action.dest not in ("help", "==SUPPRESS=="):
            keys.append(action.dest)
        for sub in (getattr(action, "_name_parser_map", None) or {}).values():
            keys.extend(_option_keys(sub))
    return sorted(set(keys))


# Arguments a class had and no longer has: (class name, argument) -> why, and what to write instead.
REMOVED_ARGUMENTS = {
    ("SuccessGatedTransfer", "measure_share_every_n_steps"):
        "it was removed: between measured steps the transfer's share of the update was not bounded "
        "(docs/probes.md, \"Cost\"); SGT now measures and bounds it on every step. Delete the key.",
}


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
        lines.append(unknown_argument_line(class_path, key))
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
        One message per config file that is empty (or comments only), whose top level is not
        a mapping of keys, that is not valid YAML or not UTF-8 (the first bad byte: its offset,
        line and column), and one per ``class_path`` in it that names no class
        (:func:`class_path_problem`, with the nearest valid classes), or whose ``init_args`` hold
        a key its class does not take (:func:`unknown_argument_line`: removed, or the nearest valid
        keys), and one per file that does not exist, with the nearest file names of its folder
        (:func:`~mrl_lightning.config.reports.missing_config_line`).
    """
    problems = []
    for path in config_paths(args):
        file = Path(path)
        if not file.is_file():
            missing = missing_config_line(path) or config_folder_line(path)  # an inline config: left to the parser
            problems.extend([missing] if missing else [])
            continue
        raw = file.read_bytes()
        try:
            data = yaml.safe_load(raw.decode("utf-8"))
            problems.extend(duplicate_key_lines(path, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
            problems.append(f"config file {path!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} "
                            f"(line {line}, column {column}) is not valid UTF-8; save the file as UTF-8 (an editor's "
                            "'save with encoding', or: iconv -f <its encoding, e.g. latin1> -t utf-8).")
            continue
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            tab = " (YAML does not allow tabs for indentation: use spaces)" if "'\\t'" in problem else ""
            problems.append(f"config file {path!r} is not valid YAML{where}: {problem}{tab}.")
            continue
        if data is None:
            problems.append(f"config file {path!r} is empty (or holds only comments): give a YAML mapping such as "
                            "'trainer: {max_steps: 10}', or leave the file out.")
        elif not isinstance(data, dict):
            problems.append(f"config file {path!r} holds a YAML {type(data).__name__}, not a mapping of keys "
                            "(trainer:, model:, data:, ...).")
        else:
            problems.extend(f"config file {path!r}: {key}: holds a YAML {type(data[key]).__name__}, not a mapping of "
                            f"its keys; indent its keys under '{key}:' without '- ' (a list item)."
                            for key in ("trainer", "model", "data")  # a list here replaced the whole section silently
                            if data.get(key) is not None and not isinstance(data[key], dict))
            for label, kind, class_path, init_args in _class_paths(data):
                reason = class_path_problem(class_path, kind)
                if reason is not None:
                    problems.append(f"config file {path!r}: {class_path_line(label, class_path, reason, kind)}")
                elif isinstance(init_args, dict) and not _accepts_any_keyword(class_path):
                    valid = set(init_arg_names(class_path))
                    problems.extend(f"config file {path!r}: {label}.init_args: {unknown_argument_line(class_path, key)}"
                                    for key in init_args if key not in valid)
    return problems


_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`(~?)\s*([^`]+?)\s*`")
_LITERAL = re.compile(r"(?<!`)``([^`]+)``(?!`)")


def plain_help(text: str) -> str:
    """One help string with the docstrings' reStructuredText markup removed.

    ``--help`` shows the ``Args:`` sections of the classes it configures; their cross
    references and literals read as code in the docs but as noise on a terminal:
    ``:class:`~mrl_lightning.loop.system.MutualRL``` -> ``MutualRL`` (``~``: the last name only),
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
        _parsed_args[:] = list(sys.argv[1:] if args is None else args)
        problems = config_file_problems(_parsed_args)
        if problems:
            self.error("\n".join(problems))
        return super().parse_args(args, *pos, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        """The error, the nearest valid key and jsonargparse's ``--help`` tip, without the 30-line usage
        block that would bury them (status 2)."""
        if not self.exit_on_error:  # a nested parser's attempt, not the final report
            return super().error(message, ex)
        # one line: a value of the wrong type, a key a class or the config does not take, a class_path that
        # names no class (given on the command line: a file's is named in parse_args)
        typed = type_message(message)  # (line, the value it names) of a value of the wrong type
        keyed = (typed and typed[0]) or _class_key_message(message) or _top_key_message(message, self)
        one_line = _class_path_message(message) or keyed  # a file's class_path: named before (parse_args)
        if keyed and one_line is keyed:  # set in a config file, not on the command line: the file is named
            where = config_file_setting(error_key(message), _parsed_args, typed[1] if typed else None)
            one_line = f"config file {where!r}: {keyed}" if where else keyed
        if one_line is not None:
            message = one_line
        hints = [] if one_line else suggestions(message, self)
        if hints:
            message = message.rstrip() + "\n" + "\n".join(hints)
        _quiet_usage[0] = True
        written, stderr = io.StringIO(), sys.stderr
        sys.stderr = written
        try:
            return super().error(message, ex)
        finally:
            sys.stderr = stderr
            _quiet_usage[0] = False
            stderr.write(_error_first(written.getvalue()))
            stderr.flush()

    def print_usage(self, file=None):
        if not _quiet_usage[0]:
            super().print_usage(file)


def _error_first(text: str) -> str:
    """jsonargparse's report with its ``tip:`` line moved after the ``error:`` line it preceded: the first line
    a reader sees is the error."""
    start = text.find("error: ")
    if start <= 0:
        return text
    head, error = text[:start], text[start:]
    return error + ("" if error.endswith("\n") else "\n") + head


def parsed_file_naming(key: str, index: int, field: str, name: str) -> str | None:
    """The ``--config`` file of this process's last ``mrl fit`` parse that named ``name`` in ``init_args.<field>``
    of entry ``index`` of the list ``key`` (:func:`~mrl_lightning.config.reports.config_file_naming`), for a check
    after the parse to name it; None when none did."""
    return config_file_naming(_parsed_args, key, index, field, name)


_parsed_args: list[str] = []  # the arguments of the parse under way: its error names the config file a key is from
_quiet_usage = [False]  # set while an error is reported: the parser that reports it prints no usage
