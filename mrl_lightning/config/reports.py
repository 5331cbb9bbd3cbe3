"""Where a jsonargparse error is about, in a user's words (docs/reliability.md, "Configuration").

jsonargparse reports a value of the wrong type as a nested union report of ten lines, and an
error about a key without the ``--config`` file it came from. :func:`type_message` turns the
first into one line naming the key as a config writes it (``data.init_args.parts``), the value
and what it must be; :func:`error_key` and :func:`config_file_setting` find the file. A ``--config``
path that names no file gets the nearest file names of its folder (:func:`missing_config_line`).
"""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import yaml

TOP_KEY = re.compile(r"does not accept option '([^']+)'")
CLASS_KEY = re.compile(r"class_path '([\w.]+)':\s*\n\s*Option '([^']+)' is not accepted")
PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_SETTING = re.compile(r"^(trainer\.\w+)=(.+?) must ")
_EXPECTED = re.compile(r"Expected a <class '(\w+)'>")
_GIVEN = re.compile(r"(?:Got value|Given value): (.*)$", re.M)
_TYPE_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
               "list": "a list ([a, b] on the command line; one '- ' item per line in a YAML file)",
               "dict": "a mapping ({key: value})", "NoneType": "null"}
"""What a value of each plain type jsonargparse names looks like, for :func:`type_message`."""


def type_message(message: str) -> tuple[str, str] | None:
    """jsonargparse's report of a value of the wrong plain type (``--seed_everything abc``, ``parts: 5``, at any
    depth of ``class_path``/``init_args``) as one line naming the key as it is written, the value and what it
    must be, and that value as the report gives it; None for any other report."""
    keys = list(PARSER_KEY.finditer(message))
    if not keys:
        return None
    last = keys[-1]
    indent = last.start() - (message.rfind("\n", 0, last.start()) + 1)
    lines = []
    for line in message[last.end():].splitlines()[1:]:  # the innermost key's report: lines indented below it
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        lines.append(line)
    report = "\n".join(lines)
    if "is not accepted" in message or re.search(r"<class '[\w]+\.[\w.]+'>", report):
        return None  # an unknown key (suggestions), or a union with a class in it: not a plain value's type
    types = list(dict.fromkeys(_EXPECTED.findall(report)))
    given = _GIVEN.search(report)
    if not types or given is None or any(t not in _TYPE_WORDS for t in types):
        return None
    key = ".init_args.".join(m.group(1) for m in keys)  # each inner key sits in the init_args of the one before
    value = given.group(1).strip()
    return (f"{key}={value!r} must be {', or '.join(_TYPE_WORDS[t] for t in types)}; `mrl fit --help` describes "
            "it."), value


def error_key(message: str) -> str | None:
    """The dotted key a jsonargparse report is about, as a config file spells it (``data.init_args.parts``)."""
    top = TOP_KEY.findall(message)
    if len(top) == 1:
        return top[0]
    keys = PARSER_KEY.findall(message)
    if not keys:
        return None
    inner = CLASS_KEY.findall(message)
    return ".init_args.".join(keys + ([inner[0][1]] if len(inner) == 1 else []))


def config_file_setting(key: str | None, args: list[str], value: str | None = None) -> str | None:
    """The ``--config`` file in ``args`` a parser error about ``key`` (dotted; a list is searched entry by entry)
    comes from, or None (the command line, or not known).

    With ``value`` (the value the error names, as text), the last file whose value of ``key`` reads the same;
    without, the last file that sets ``key``.
    """
    if not key:
        return None
    where = None
    for path, data in _config_files(args):
        found = _values(data, key.split("."))
        if found and (value is None or any(str(v) == value for v in found)):
            where = path
    return where


def with_config_file(line: str, args: list[str]) -> str:
    """``line`` (``trainer.<key>=<value> must ...``, :func:`mrl_lightning.config.preflight.trainer_errors`) led by the
    ``--config`` file in ``args`` that set that value, when one did (docs/reliability.md, row 24b)."""
    found = _SETTING.match(line)
    if not found:
        return line
    try:
        value = str(ast.literal_eval(found.group(2)))
    except (ValueError, SyntaxError):
        value = found.group(2)
    where = config_file_setting(found.group(1), args, value)
    return f"config file {where!r}: {line}" if where else line


def _config_files(args: list[str]):
    """``(path, content)`` of each ``--config`` file in ``args`` that reads as YAML, in order."""
    for path in config_paths(args):
        try:
            yield path, yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue


def config_paths(args: list[str]) -> list[str]:
    """The ``--config`` files named in ``args`` (``--config F``, ``-c F``, ``--config=F``), in order."""
    paths = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            paths.append(args[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def _values(node, parts: list[str]) -> list:
    """The values the YAML ``node`` holds at the dotted key ``parts`` (any entry of a list along the way)."""
    if not parts:
        return [node]
    if isinstance(node, list):
        return [v for entry in node for v in _values(entry, parts)]
    return _values(node[parts[0]], parts[1:]) if isinstance(node, dict) and parts[0] in node else []


def missing_config_line(value: str) -> str | None:
    """One line for a ``--config`` value that names no file: the file names of its folder nearest to it
    (``difflib``), or that the folder does not exist; None for a file that exists, or a value that is a config
    written inline (``--config '{trainer: {max_steps: 3}}'``, which jsonargparse parses as YAML)."""
    path = Path(value)
    try:
        inline = not isinstance(yaml.safe_load(value), str)
    except yaml.YAMLError:
        inline = False
    if path.exists() or inline:
        return None
    folder = path.parent
    if not folder.is_dir():
        return (f"--config {value!r}: no such file (its folder {str(folder)!r} does not exist either); give the "
                "path of a YAML file, e.g. configs/default.yaml.")
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml", ".json"))
    near = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    shown = [n if str(folder) == "." else str(folder / n) for n in near]
    if near:
        return f"--config {value!r}: no such file; did you mean {' or '.join(map(repr, shown))}?"
    listed = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
    return (f"--config {value!r}: no such file; the config files in {str(folder)!r} are: {listed or 'none'}.")


def config_file_naming(args: list[str], key: str, index: int, field: str, name: str) -> str | None:
    """The last ``--config`` file in ``args`` whose list ``key`` (``trainer.callbacks``) holds at ``index`` an entry
    whose ``init_args.<field>`` names ``name`` (a key of its mapping, or an item of its list); None when none does."""
    where = None
    for path, data in _config_files(args):
        entries = _values(data, key.split("."))
        entries = entries[0] if len(entries) == 1 and isinstance(entries[0], list) else []
        entry = entries[index] if index < len(entries) and isinstance(entries[index], dict) else {}
        value = (entry.get("init_args") or {}).get(field) if isinstance(entry.get("init_args"), dict) else None
        if isinstance(value, (dict, list)) and name in value:
            where = path
    return where


UNION = "Does not validate against any of the Union subtypes"
_ONE_OF = re.compile(r"^(?P<field>[\w.]+)=(?P<value>'[^']*'|\S+); valid: (?P<valid>\[[^\]]*\])\.$")
_UNKNOWN = re.compile(r"^(?P<field>[\w.]+) has unknown (?P<value>\[[^\]]*\]); valid: (?P<valid>\[[^\]]*\])\.$")
_HEADER = re.compile(r"^Invalid [\w ]+ config:$")


def union_cause(message: str) -> str | None:
    """jsonargparse's report that a value fits none of a union's types (a recipe, a callback list: 9 lines and a
    dump of every value) as the error of the class that refused it: its ``Invalid <class> config:`` header, if
    any, and each cause as one line (:func:`with_nearest`); the tries at the union's other types (``Expected a
    <class 'str'>``) and the dump of the given value left out. None for another report, or one with no cause."""
    if UNION not in message:
        return None
    block = message.split("\nErrors:\n", 1)[-1].split("\nGiven value", 1)[0]
    header, causes = None, []
    for line in block.splitlines():
        text = line.strip()
        text = text[2:] if text.startswith("- ") else text
        if not text or text.startswith(("Expected a ", "Subtypes:", UNION, "Errors:")):
            continue
        if _HEADER.match(text):
            header = header or text
        elif not text.endswith(":"):
            causes.append(with_nearest(text))
    if not causes:
        return None
    return f"{header or 'Invalid config:'}\n  - " + "\n  - ".join(dict.fromkeys(causes))


def nearest_first(value: str, valid: list[str]) -> list[str]:
    """``valid``, the names nearest to ``value`` first (``difflib``'s ratio), ties in their own order."""
    score = {v: difflib.SequenceMatcher(None, value.lower(), str(v).lower()).ratio() for v in valid}
    return sorted(valid, key=lambda v: -score[v])


def with_nearest(line: str) -> str:
    """A class's ``X.field='value'; valid: [...]`` (or ``X.field has unknown [...]; valid: [...]``) with the
    nearest valid value, the valid ones nearest first and the fix; any other line as it is."""
    import ast

    one, many = _ONE_OF.match(line), _UNKNOWN.match(line)
    try:
        found = one or many
        valid = ast.literal_eval(found.group("valid")) if found else None
        given = ast.literal_eval(found.group("value")) if found else None
    except (ValueError, SyntaxError):
        return line
    if not found or not isinstance(valid, list) or not valid:
        return line
    field = found.group("field").rsplit(".", 1)[-1]
    if one:
        ranked = nearest_first(str(given), valid)
        near = difflib.get_close_matches(str(given), valid, n=1, cutoff=0.5)
        fix = f"did you mean {near[0]!r}? " if near else ""
        return (f"{found.group('field')}={given!r} is not one of its values; {fix}valid (nearest first): {ranked}. "
                f"Set {field}: {near[0] if near else ranked[0]}.")
    if not isinstance(given, list):
        return line
    fixes = [(g, difflib.get_close_matches(str(g), valid, n=1, cutoff=0.5)) for g in given]
    said = "; ".join(f"did you mean {n[0]!r} for {g!r}?" for g, n in fixes if n)
    ranked = nearest_first(str(given[0]), valid)
    return (f"{found.group('field')} has unknown {given}" + (f"; {said}" if said else "") + f" valid (nearest "
            f"first): {ranked}. " + ("Replace " + ", ".join(f"{g!r} by {n[0]!r}" for g, n in fixes if n) + " in "
                                     f"{field}." if said else f"Name only valid values in {field}."))


def duplicate_key_lines(path: str, text: str) -> list[str]:
    """One line per key given twice in one mapping of the YAML ``text`` of config file ``path`` (PyYAML keeps the
    last silently): the dotted key and both line numbers. Empty for a file without (or not valid YAML)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return []
    lines, todo = [], [(root, "")]
    while todo:
        node, prefix = todo.pop()
        if isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{prefix}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = str(key.value)
                where = f"{prefix}.{name}" if prefix else name
                line = key.start_mark.line + 1
                if name in first:
                    lines.append((first[name], f"config file {path!r}: {where!r} is given twice, on lines {first[name]} "
                                              f"and {line}; YAML would keep the second silently. Delete one of them."))
                else:
                    first[name] = line
                todo.append((value, where))
    return [line for _, line in sorted(lines)]


def config_folder_line(value: str) -> str | None:
    """One line for a ``--config`` value that is a folder: its YAML files, or None when it is not a folder."""
    folder = Path(value)
    if not folder.is_dir():
        return None
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml"))
    shown = ", ".join(str(folder / n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
    return (f"--config {value!r} is a folder; give one YAML file in it" + (f": {shown}." if names else
                                                                           " (it holds none)."))


def model_file_lines(args: list[str]) -> list[str]:
    """One line per policy ``model`` (``--model.policies.init_args.model`` or a config file's ``model.policies``)
    that names an existing plain file other than a ``.gguf``: jsonargparse reads such a value as a file and puts
    the file's contents in its place, so the error that follows names neither the file nor the fix."""
    given = [(None, args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--model.policies.init_args.model"]
    given += [(None, a.split("=", 1)[1]) for a in args if a.startswith("--model.policies.init_args.model=")]
    for path in config_paths(args):
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        given += [(path, v) for v in _values(data, "model.policies.init_args.model".split(".")) if isinstance(v, str)]
    lines = []
    for where, value in given:
        file = Path(value).expanduser()
        if file.suffix.lower() != ".gguf" and file.is_file():
            lines.append((f"config file {where!r}: " if where else "") + f"model.policies.init_args.model={value!r} "
                         "is a file, not a model: a model is a folder written by save_pretrained (config.json and the "
                         "weights), a .gguf file, a hub id (org/name) or a recipe (class_path: "
                         f"mrl_lightning.recipes.TinyCausalLM). Give the folder that holds the model, e.g. "
                         f"{str(file.parent)!r} if it is the one.")
    return lines


def _class_names(callbacks) -> str:
    names = [str(c.get("class_path", "?")).rsplit(".", 1)[-1] if isinstance(c, dict) else str(c).rsplit(".", 1)[-1]
             for c in (callbacks if isinstance(callbacks, list) else [callbacks])]
    return ", ".join(names)


def _probe_file(content) -> bool:
    """Whether a config file sets ``trainer.callbacks`` and nothing else (a probe's file, callbacks/*.yaml)."""
    return (isinstance(content, dict) and set(content) == {"trainer"} and isinstance(content["trainer"], dict)
            and set(content["trainer"]) == {"callbacks"})


def replaced_setting_notes(args: list[str]) -> list[str]:
    """A note for each setting a later ``--config`` file replaces without a word (jsonargparse: later wins).

    - ``--trainer.max_steps 2 --config configs/default.yaml``: the file's ``max_steps`` (2500) is the one
      that runs; the override given before it is lost.
    - ``--config callbacks/none.yaml --config configs/default.yaml``: the second file's
      ``trainer.callbacks`` (its probe) replace those of the probe's file (a file that sets
      ``trainer.callbacks`` only), so the run is another arm than the file named for it. A probe's
      file given after a config (the README's order) is what it is for, and gets no note.

    Args:
        args: ``mrl fit``'s arguments (``fit`` first, or not).

    Returns:
        One line per replaced setting, naming the option or file, the file that replaced it, and
        the order that keeps it; [] when nothing is replaced (or a file does not read as YAML).
    """
    files = dict(_config_files(args))
    notes, overrides, callbacks_from, replaced = [], [], None, []
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        step = 1 if eq else 2
        if name in ("--config", "-c") and value is not None:
            content = files.get(value)
            for key, given in overrides:
                found = _values(content, key.split(".")) if isinstance(content, dict) else []
                if found:
                    replaced.append((key, f"note: --{key} {given} is replaced by {value}'s {key}: {found[0]!r} (a "
                                          f"--config given after an option wins); put --{key} after the --config "
                                          "files to keep it."))
            overrides = [(k, g) for k, g in overrides if not (isinstance(content, dict) and _values(content, k.split(".")))]
            sets = isinstance(content, dict) and bool(_values(content, ["trainer", "callbacks"]))
            if sets and callbacks_from is not None and not _probe_file(content):
                first, cbs = callbacks_from
                notes.append(f"note: the trainer.callbacks of {first} ({_class_names(cbs)}) are replaced by "
                             f"{value}'s ({_class_names(_values(content, ['trainer', 'callbacks'])[0])}): a later "
                             f"--config wins. To run {first}'s, give it last: --config {value} --config {first}.")
            if sets:  # a probe file (callbacks/*.yaml) is what a later config replaces by mistake
                callbacks_from = (value, _values(content, ["trainer", "callbacks"])[0]) if _probe_file(content) else None
        elif name.startswith("--") and not name.endswith("+") and name not in ("--config", "-c") and value is not None \
                and (eq or not value.startswith("-")):
            overrides.append((name[2:], value))
            replaced = [(k, line) for k, line in replaced if k != name[2:]]  # given again after the file: it holds
        else:
            step = 1
        i += step
    return [line for _, line in replaced] + notes
