"""GGUFModel: a policy's model from a GGUF file, converted once into the model cache (docs/real_models.md).

Three ways to write it in a policy's config::

    model: pypi:smollm2-135m-instruct             # a packaged model by its short name (packaged.py)
    model: /models/SmolLM2-135M-Instruct.Q4_1.gguf  # a .gguf file
    model:                                          # the same, as a recipe (a folder and a file name)
      class_path: mrl_lightning.gguf.GGUFModel
      init_args: {path: /models, file: SmolLM2-135M-Instruct.Q4_1.gguf}

The first use converts the file into ``$MRL_CACHE_DIR/models/gguf-<name>-<key>/``, an ordinary
``save_pretrained`` folder (:func:`~mrl_lightning.gguf.convert.convert_gguf`), written under
``.converting-<pid>-*`` and renamed when whole; later runs find it and load it in seconds. The
key hashes what the folder depends on: the file (its sha256, or a packaged model's
distribution, version and pinned sha256), the transformers version that dequantized it and the
converted folder's format. What was loaded (file, quantization, sha256) is printed with the
resource plan and written into the run folder (``model_sources.json``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from mrl_lightning.errors import ConfigError
from mrl_lightning.gguf.convert import FORMAT, convert_gguf, host_label, read_provenance, stale_temporaries
from mrl_lightning.gguf.files import GGUFFileError, file_type_name, read_header, sha256_of
from mrl_lightning.gguf.packaged import PACKAGED, REAL_EXTRA, packaged
from mrl_lightning.model.source import ModelRecipe, default_cache_dir
from mrl_lightning.writable import write_problem

PYPI_PREFIX = "pypi:"


class GGUFModel(ModelRecipe):
    """A model read from a GGUF file, dequantized to float32 once and cached as a ``save_pretrained`` folder.

    Args:
        path: A ``.gguf`` file, or a folder holding ``file``.
        file: The GGUF file's name inside the folder ``path``; None when ``path`` is the file.
        package: Instead of ``path``: the short name of a packaged model (``smollm2-135m-instruct``,
            ``gemma-3-270m``; :data:`~mrl_lightning.gguf.packaged.PACKAGED`), installed from PyPI.
        cache_dir: Root of the model cache; None = ``$MRL_CACHE_DIR`` or ``~/.cache/mrl_lightning``.

    Raises:
        ConfigError: neither or both of ``path`` and ``package``, ``file`` without ``path``, or an
            unknown ``package`` (all at once).
    """

    def __init__(self, path: str | None = None, file: str | None = None, package: str | None = None,
                 cache_dir: str | None = None) -> None:
        errors = []
        if (path is None) == (package is None):
            errors.append(f"GGUFModel: give exactly one of path (a .gguf file or its folder) and package (one of "
                          f"{sorted(PACKAGED)}); got path={path!r}, package={package!r}.")
        if file is not None and path is None:
            errors.append(f"GGUFModel.file={file!r} needs path: the folder that holds it.")
        if package is not None:
            try:
                packaged(package)
            except KeyError as exc:
                errors.append(f"GGUFModel.package={package!r}: {exc.args[0]}.")
        if errors:
            raise ConfigError("Invalid GGUFModel config:\n  - " + "\n  - ".join(errors))
        self.path, self.file, self.package, self.cache_dir = path, file, package, cache_dir
        self._config = None

    # ----------------------------------------------------------------- what it is
    @property
    def label(self) -> str:
        """How the config names it: ``pypi:<name>`` or the file's path."""
        if self.package is not None:
            return PYPI_PREFIX + self.package
        return str(Path(self.path) / self.file) if self.file else str(self.path)

    @property
    def config_is_exact(self) -> bool:
        """A GGUF file's config is the converted model's exactly (the plan shows no upper bounds)."""
        return True

    def _root(self) -> Path:
        return Path(self.cache_dir or default_cache_dir()).expanduser()

    def gguf_path(self) -> Path:
        """The GGUF file (a packaged model's, assembled into the cache if it comes in chunks).

        Raises:
            GGUFFileError: no such file, or a folder ``path`` without ``file`` that holds not exactly one.
        """
        if self.package is not None:
            try:
                return packaged(self.package).file_path(self._root())
            except (FileNotFoundError, ValueError) as exc:
                raise GGUFFileError(f"model={self.label!r}: {exc}") from exc
        path = Path(self.path).expanduser()
        if self.file is not None:
            return path / self.file
        if path.is_dir():
            found = sorted(path.glob("*.gguf"))
            if len(found) != 1:
                raise GGUFFileError(f"model={self.label!r} is a folder holding {len(found)} .gguf files "
                                    f"{[p.name for p in found][:5]}; name one: GGUFModel(path=..., file=<name>).")
            return found[0]
        return path

    def source_errors(self, where: str) -> list[str]:
        """What this environment lacks to load it: the packaged model's distribution, the file, the
        ``gguf`` package (needed until the file is converted), each with its install line."""
        if self.package is not None:
            why = packaged(self.package).missing()
            if why:
                return [f"{where}: model={self.label!r} {why}"]
        else:
            try:
                read_header(self.gguf_path())
            except GGUFFileError as exc:
                return [f"{where}: model={self.label!r}: {exc}"]
        if self._built() is None and importlib.util.find_spec("gguf") is None:
            return [f"{where}: model={self.label!r} is a GGUF file, and reading it needs the gguf package, not "
                    f"installed here: {REAL_EXTRA}  (or pip install gguf)."]
        return []

    def cache_key(self) -> str:
        """Hash of the file (a packaged model: distribution, version, file, pinned sha256), the transformers
        and gguf versions that dequantize it and :data:`~mrl_lightning.gguf.convert.FORMAT`."""
        import transformers

        if self.package is not None:
            entry = packaged(self.package)
            what = {"package": entry.distribution, "version": entry.installed_version(), "file": entry.file,
                    "sha256": entry.sha256}
        else:
            what = {"sha256": sha256_of(self.gguf_path())}
        content = {**what, "transformers": transformers.__version__, "gguf": _gguf_version(), "format": FORMAT}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]

    def cache_folder(self) -> Path:
        """Where the converted folder is (or will be): ``<cache>/models/gguf-<file stem>-<key>``."""
        stem = re.sub(r"[^a-z0-9._-]+", "-", self.gguf_file_name().lower().removesuffix(".gguf"))
        return self._root() / "models" / f"gguf-{stem}-{self.cache_key()}"

    def gguf_file_name(self) -> str:
        """The file's name (without reading or assembling it)."""
        if self.package is not None:
            return packaged(self.package).file
        return self.file or Path(self.path).name

    def _built(self) -> Path | None:
        try:
            folder = self.cache_folder()
        except (OSError, GGUFFileError):
            return None
        return folder if read_provenance(folder) is not None else None

    # ------------------------------------------------------------ ModelRecipe API
    def built_folder(self, policy, datamodule) -> Path | None:
        """The converted folder when an earlier run made it (a cache hit), else None."""
        return self._built()

    def config_errors(self, policy, datamodule) -> list[str]:
        """A cache that cannot be written while the file is not converted yet."""
        if self._built() is not None:
            return []
        root = self._root() / "models"
        problem = write_problem(root)
        if problem is None:
            return []
        field = (f"GGUFModel.cache_dir={self.cache_dir!r}" if self.cache_dir else
                 f"MRL_CACHE_DIR={os.environ['MRL_CACHE_DIR']!r}" if os.environ.get("MRL_CACHE_DIR") else
                 f"the model cache {str(root.parent)!r} (MRL_CACHE_DIR unset)")
        return [f"policy {policy.policy_name!r}: {field} cannot be written ({problem}), and model={self.label!r} is "
                "not converted yet: it is converted into the cache. Set MRL_CACHE_DIR to a folder you can write."]

    def materialize(self, policy, datamodule, log: Callable[[str], None] = print,
                    warn_shortfall: bool = True) -> Path:
        """The converted folder, converting the file first when it is not in the cache.

        Raises:
            GGUFFileError: the file is missing, not GGUF, or cannot be loaded (damaged, truncated).
        """
        name = policy.policy_name
        final = self.cache_folder()
        if read_provenance(final) is not None:
            log(f"[{name}] GGUF cache hit: {final}")
            return final
        root = final.parent
        root.mkdir(parents=True, exist_ok=True)
        for stale in stale_temporaries(root):  # left by a conversion that was killed
            shutil.rmtree(stale, ignore_errors=True)
        path = self.gguf_path()
        entry = packaged(self.package) if self.package is not None else None
        if entry is not None and sha256_of(path) != entry.sha256:
            raise GGUFFileError(f"policy {name!r}: model={self.label!r}: {str(path)!r} has sha256 {sha256_of(path)}, "
                                f"not the {entry.sha256} this project pins; reinstall: {entry.install}")
        log(f"[{name}] converting {path.name} ({path.stat().st_size / 1e6:.0f} MB) once into {final} "
            "(tens of seconds; later runs load the folder)")
        tmp = Path(tempfile.mkdtemp(prefix=f".converting-{host_label()}-{os.getpid()}-", dir=root))
        source = ({"kind": "package", "package": entry.distribution, "version": entry.installed_version(),
                   "name": PYPI_PREFIX + entry.name} if entry else {"kind": "file"})
        try:
            convert_gguf(path, tmp, source, log=lambda msg: log(f"[{name}] {msg}"))
            if final.exists() and read_provenance(final) is None:  # not a finished conversion
                shutil.rmtree(final, ignore_errors=True)
            _publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def model_config(self):
        """The ``transformers`` config: the converted folder's, else read from the file's metadata once
        (seconds: transformers parses every metadata value) and kept in ``<cache>/models/gguf-configs``."""
        from transformers import AutoConfig

        if self._config is not None:
            return self._config
        built = self._built()
        if built is not None:
            self._config = AutoConfig.from_pretrained(str(built))
            return self._config
        memo = self._root() / "models" / "gguf-configs" / self.cache_key()
        if not (memo / "config.json").is_file():
            path = self.gguf_path()
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            tmp = Path(tempfile.mkdtemp(prefix=".config-", dir=_made(memo.parent)))
            config.save_pretrained(str(tmp))
            _publish(tmp, memo)
        self._config = AutoConfig.from_pretrained(str(memo))
        return self._config

    def describe(self, policy, datamodule) -> str | None:
        """``<policy>: <file> (<quantization>, sha256 <first 12>) -> <folder> (cache hit | converts on first use)``."""
        built = self._built()
        prov = read_provenance(built) if built is not None else None
        if prov is not None:
            what = f"{prov['quantization']['file_type']} dequantized to float32, sha256 {prov['sha256'][:12]}"
            return f"{policy.policy_name}: {self.label} = {Path(prov['file']).name} ({what}) -> {built} (cache hit)"
        try:
            path = self.gguf_path()
            what = f"{file_type_name(read_header(path))}, sha256 {sha256_of(path)[:12]}"
            folder = self.cache_folder()
        except (OSError, GGUFFileError) as exc:
            return f"{policy.policy_name}: {self.label} ({exc})"
        return f"{policy.policy_name}: {self.label} = {path.name} ({what}) -> {folder} (converted on first use)"

    def provenance(self, policy, datamodule) -> dict | None:
        """The converted folder's ``gguf_source.json`` plus the folder itself; None before conversion."""
        built = self._built()
        prov = read_provenance(built) if built is not None else None
        if prov is not None and self.package is None:  # a copy of the file elsewhere hits the same entry
            prov = {**prov, "file": str(self.gguf_path()), "converted_from": prov.get("file")}
        return None if prov is None else {"model": self.label, "folder": str(built), **prov}


def _gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # noqa: BLE001 - not installed: the conversion itself says so
        return "none"


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``; when another process got there first (a rename onto
    its non-empty folder fails), keep theirs and drop ``tmp``."""
    try:
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def model_from_string(model: str | ModelRecipe) -> str | ModelRecipe:
    """A ``model:`` string that names a GGUF source as its :class:`GGUFModel`; anything else unchanged.

    ``pypi:<name>`` is a packaged model; a string ending in ``.gguf`` is a file.

    Raises:
        ConfigError: ``pypi:`` with an unknown name (the message lists the known ones).
    """
    if not isinstance(model, str):
        return model
    if model.startswith(PYPI_PREFIX):
        return GGUFModel(package=model[len(PYPI_PREFIX):])
    if model.lower().endswith(".gguf"):
        return GGUFModel(path=model)
    return model
