"""Load any tokenizer THL can work with, including the ones in the mistral-common wheel (docs/thl.md).

``load_tokenizer(spec)`` accepts:

- ``"mistral-v1"``: SentencePiece, 32,000 pieces (``tokenizer.model.v1``);
- ``"mistral-v3"``: SentencePiece, 32,768 pieces (``mistral_instruct_tokenizer_240323.model.v3``);
- ``"tekken"``: Tekken, 131,072 ids (``tekken_240911.json``);
- a local folder holding a Hugging Face tokenizer;
- a hub id (resolved by ``AutoTokenizer.from_pretrained``; offline it needs the hub cache).

The mistral-common files are converted once into Hugging Face fast tokenizers and
cached under ``$MRL_CACHE_DIR/tokenizers`` (default ``~/.cache/mrl_lightning/tokenizers``),
keyed on the source file's hash and the versions of every library that shapes the
result (mistral-common, tokenizers, transformers, sentencepiece): :func:`cache_key`.
Departures from a plain ``from_pretrained``, each for a reason found by testing (docs/thl.md):

- SentencePiece files are built into fast tokenizers by :mod:`mrl_lightning.thl.spm_fast`
  from the model's protobuf, not by ``transformers``' converter: that converter gives
  different ids across the ``transformers`` releases this project admits (5.16-5.23 vs
  5.24). Each build is checked against SentencePiece's own encoder before it is cached.
  (Loading the file through ``transformers`` needs it copied to ``DIR/tokenizer.model``:
  ``LlamaTokenizerFast(vocab_file=".../tokenizer.model.v1")`` silently builds a 3-token
  tokenizer.)
- The three Mistral tokenizers add BOS (``<s>``) to every encoded text, as Mistral's
  models and hub tokenizers do; the bare conversions add nothing.
- Leading-space check: a SentencePiece-style tokenizer whose encoder adds no dummy
  prefix to a text that starts with a space while its decoder strips one (what
  ``LlamaTokenizerFast.from_pretrained`` builds for Mistral v1) loses that space on
  decode. :func:`leading_space_failures` detects it and :func:`fix_leading_space`
  makes the encoder always add the dummy prefix, as SentencePiece itself does;
  ``load_tokenizer`` applies both to every tokenizer it returns.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import normalizers
from tokenizers.processors import TemplateProcessing

logger = logging.getLogger(__name__)

MISTRAL_FILES = {
    "mistral-v1": "tokenizer.model.v1",
    "mistral-v3": "mistral_instruct_tokenizer_240323.model.v3",
    "tekken": "tekken_240911.json",
}
_CACHE_VERSION = 2  # 2: SentencePiece files built by spm_fast, not by transformers' converter
_KEY_LIBRARIES = ("mistral_common", "tokenizers", "transformers", "sentencepiece")
_MARKER = "mrl_thl_source.json"
LEADING_SPACE_PROBES = (
    " hello", " 68", "  two spaces", " The answer is 42.", " \u4e2d\u6587", " \n", " a b",
    "   ", " x\ty", " 2+2=4", " (note)", " caf\u00e9", " \U0001F600",
)


def default_cache_dir() -> Path:
    """``$MRL_CACHE_DIR/tokenizers`` or ``~/.cache/mrl_lightning/tokenizers``."""
    root = os.environ.get("MRL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mrl_lightning")
    return Path(root) / "tokenizers"


def mistral_data_dir() -> Path:
    """Folder of the tokenizer files shipped in the mistral-common wheel.

    Raises:
        ImportError: If mistral-common is not installed.
    """
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


def leading_space_failures(tokenizer: Any, texts: tuple[str, ...] = LEADING_SPACE_PROBES) -> list[str]:
    """Texts among ``texts`` that ``decode(encode(x))`` does not give back.

    Args:
        tokenizer: A Hugging Face tokenizer.
        texts: Probe strings (by default, strings that start with whitespace).

    Returns:
        The failing texts, in order (empty when all round-trip).
    """
    bad = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if tokenizer.decode(ids, skip_special_tokens=True) != text:
            bad.append(text)
    return bad


def fix_leading_space(tokenizer: Any) -> bool:
    """Make a Metaspace tokenizer always add its dummy prefix (SentencePiece behaviour).

    The encoder's ``Metaspace(prepend_scheme="first"|"always")`` skips the prefix when
    the text already starts with a space, while the decoder's ``Strip`` removes one:
    a leading space is lost. The fix moves the prefix into the normalizer
    (``Prepend("▁")``, applied to every non-empty text) and sets the pre-tokenizer's
    ``prepend_scheme`` to ``"never"``. Edits ``tokenizer.backend_tokenizer`` in place.

    Args:
        tokenizer: A Hugging Face fast tokenizer.

    Returns:
        True if the tokenizer was changed, False if it has no prepending Metaspace.
    """
    from tokenizers import Tokenizer

    backend = tokenizer.backend_tokenizer
    spec = json.loads(backend.to_str())
    nodes = [spec["pre_tokenizer"]] if spec.get("pre_tokenizer") else []
    if nodes and nodes[0].get("type") == "Sequence":
        nodes = nodes[0]["pretokenizers"]
    metas = [n for n in nodes if n.get("type") == "Metaspace" and n.get("prepend_scheme") in ("first", "always")]
    if not metas:
        return False
    for node in metas:
        node["prepend_scheme"] = "never"
    prepend = json.loads(normalizers.Prepend(metas[0].get("replacement", "\u2581")).__getstate__())
    norm = spec.get("normalizer")
    if norm is None:
        spec["normalizer"] = prepend
    elif norm.get("type") == "Sequence":
        norm["normalizers"].append(prepend)
    else:
        spec["normalizer"] = {"type": "Sequence", "normalizers": [norm, prepend]}
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(spec))
    for attr in ("_mrl_thl_byte_table", "_mrl_thl_retok_state", "_mrl_thl_fingerprint"):
        if hasattr(tokenizer, attr):
            setattr(tokenizer, attr, None)
    return True


def _add_bos(tokenizer: Any) -> None:
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _convert_mistral(name: str, out_dir: Path) -> None:
    """Convert one mistral-common file into a saved Hugging Face tokenizer at ``out_dir``.

    Raises:
        RuntimeError: If a SentencePiece build encodes a self-check text differently from
            SentencePiece itself (nothing is cached then).
    """
    from mrl_lightning.thl.spm_fast import sentencepiece_mismatches, sentencepiece_to_fast

    source = mistral_data_dir() / MISTRAL_FILES[name]
    if name == "tekken":
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer  # transformers >= 5.15

        tok = convert_tekken_tokenizer(str(source))
    else:
        tok = sentencepiece_to_fast(source)
        wrong = sentencepiece_mismatches(tok, source)
        if wrong:
            raise RuntimeError(
                f"tokenizer {name!r}: the fast tokenizer built from {source.name} encodes {len(wrong)} self-check "
                f"texts differently from SentencePiece (first: {wrong[0]!r}) with {_versions()}. Nothing was "
                "cached. Install the versions pyproject.toml names, or report this with that line."
            )
    _add_bos(tok)
    staged = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{name}-"))
    tok.save_pretrained(str(staged))
    (staged / _MARKER).write_text(json.dumps(cache_key(name)))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(staged, out_dir)


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"


def _versions() -> str:
    return ", ".join(f"{lib} {_version(lib)}" for lib in _KEY_LIBRARIES)


def _cache_is_current(folder: Path, name: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == cache_key(name)


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_key(name: str) -> dict:
    """What a cached conversion of ``name`` was built from; any difference rebuilds it.

    The source file (name and SHA-256) and the version of every library that shapes the
    saved files: mistral-common (ships the file), tokenizers (builds and serializes the
    pipeline), transformers (wraps and saves it; converts Tekken), sentencepiece (parses
    the model and checks the build).

    Args:
        name: One of :data:`MISTRAL_FILES`.

    Returns:
        A JSON-serializable dict, stored next to the cached tokenizer.
    """
    source = mistral_data_dir() / MISTRAL_FILES[name]
    return {"cache_version": _CACHE_VERSION, "source": MISTRAL_FILES[name], "sha256": _sha256(source),
            **{lib: _version(lib) for lib in _KEY_LIBRARIES}}


def load_tokenizer(spec: str, cache_dir: str | os.PathLike | None = None, fix_leading_space_loss: bool = True,
                   hub_kwargs=None) -> Any:
    """Load a Hugging Face fast tokenizer by name, folder or hub id (docs/thl.md).

    Args:
        spec: ``"mistral-v1"``, ``"mistral-v3"``, ``"tekken"``, a local folder, or a hub id.
        cache_dir: Where converted mistral-common tokenizers are kept (default
            :func:`default_cache_dir`).
        fix_leading_space_loss: Apply :func:`fix_leading_space` when
            :func:`leading_space_failures` finds a lost leading space.
        hub_kwargs: ``spec -> from_pretrained kwargs`` for a folder or hub id, e.g. the hub's fast
            offline check (it raises at once for an id it cannot reach); None = none.

    Returns:
        A ``transformers`` fast tokenizer.

    Raises:
        ValueError: If ``spec`` is empty, or names no known tokenizer, folder or hub id
            (the message lists the valid names).
        TypeError: If the loaded tokenizer is not a fast tokenizer.
        RuntimeError: If a Mistral SentencePiece build disagrees with SentencePiece on its
            self-check texts (the message names the library versions; nothing is cached).
    """
    from transformers import AutoTokenizer

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"tokenizer spec: got {spec!r}; give one of {sorted(MISTRAL_FILES)}, a folder or a hub id.")
    if spec in MISTRAL_FILES:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        folder = root / spec
        if not _cache_is_current(folder, spec):
            root.mkdir(parents=True, exist_ok=True)
            _convert_mistral(spec, folder)
        path = str(folder)
    else:
        path = spec
    extra = hub_kwargs(spec) if hub_kwargs is not None and spec not in MISTRAL_FILES else {}
    try:
        tok = AutoTokenizer.from_pretrained(path, use_fast=True, **extra)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"tokenizer spec: could not load {spec!r} ({type(err).__name__}: {err}). Valid: one of "
            f"{sorted(MISTRAL_FILES)}, a folder with tokenizer.json / tokenizer.model, or a hub id present in "
            "the local hub cache (no network here)."
        ) from err
    if getattr(tok, "backend_tokenizer", None) is None:
        raise TypeError(
            f"tokenizer spec {spec!r} loaded a slow tokenizer ({type(tok).__name__}); THL needs a fast one "
            "(a folder with tokenizer.json, or install the converter's dependencies)."
        )
    if fix_leading_space_loss:
        lost = leading_space_failures(tok)
        before = tok.backend_tokenizer
        if lost and fix_leading_space(tok):
            still = leading_space_failures(tok)
            if len(still) >= len(lost):
                tok._tokenizer = before
                still = lost
            logger.warning(
                "tokenizer %r lost the leading space on decode for %d of %d probe texts; after the fix %d remain "
                "(mrl_lightning.thl.loader.fix_leading_space).", spec, len(lost), len(LEADING_SPACE_PROBES), len(still)
            )
    return tok
