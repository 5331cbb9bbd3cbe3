"""Hub ids without a network: fail at once with the offline hint, or load from the local cache.

``from_pretrained("org/name")`` with no network and ``HF_HUB_OFFLINE`` unset does not fail
fast: huggingface_hub retries each file request with back-off, and loading one tokenizer
took 59 s here before the final "We couldn't connect to 'https://huggingface.co'" error
(a model and its config cost as much again). Before a policy loads anything by hub id,
:func:`hub_load_kwargs` asks once per process whether the hub answers at all (a TCP
connection to the endpoint, or to the HTTPS proxy when one is set, bounded by
:data:`PROBE_TIMEOUT_S`), then:

====================  =====================  =========================================
hub answers           id in the local cache  result
====================  =====================  =========================================
yes                   any                    ``{}``: the usual ``from_pretrained``
no                    yes                    ``{"local_files_only": True}``: the cached
                                             files, no request
no                    no                     :class:`HubUnreachableError` naming the
                                             field, the id and the fix
``HF_HUB_OFFLINE=1``  no                     :class:`HubUnreachableError`
====================  =====================  =========================================

Local folders are never probed.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

from mrl_lightning.errors import ConfigError

PROBE_TIMEOUT_S = 5.0
_TRUE = {"1", "on", "yes", "true"}
_probe: dict[str, tuple[bool, str]] = {}
_lock = threading.Lock()


class HubUnreachableError(ConfigError):
    """A hub id is not cached and the hub cannot be reached (or offline mode is on)."""


def is_local_source(source: str) -> bool:
    """True when ``source`` names a local path rather than a hub id ``org/name``."""
    expanded = os.path.expanduser(source)
    return source.startswith((".", "/", "~")) or os.path.isabs(source) or os.path.exists(expanded)


def offline_mode() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _probe_target() -> tuple[str, int, str]:
    """``(host, port, label)`` of the first hop to the hub: the HTTPS proxy if one is set, else the endpoint."""
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(key):
            url = urlparse(os.environ[key] if "://" in os.environ[key] else f"http://{os.environ[key]}")
            return url.hostname or "", url.port or 80, f"proxy {os.environ[key]}"
    url = urlparse(_endpoint())
    return url.hostname or "", url.port or (443 if url.scheme == "https" else 80), _endpoint()


def hub_reachable() -> tuple[bool, str]:
    """Whether a TCP connection to the hub (or its proxy) opens within :data:`PROBE_TIMEOUT_S`.

    Asked once per process and target. Returns ``(reachable, what was tried and why not)``.
    """
    host, port, label = _probe_target()
    with _lock:
        if label in _probe:
            return _probe[label]
        box: dict[str, str] = {}

        def connect() -> None:
            try:
                socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
                box["ok"] = ""
            except OSError as exc:
                box["error"] = f"{type(exc).__name__}: {exc}"

        worker = threading.Thread(target=connect, daemon=True)  # name resolution has no timeout of its own
        worker.start()
        worker.join(PROBE_TIMEOUT_S + 0.5)
        if "ok" in box:
            _probe[label] = (True, label)
        else:
            why = box.get("error", f"no answer within {PROBE_TIMEOUT_S:g} s")
            _probe[label] = (False, f"{label} cannot be reached ({why})")
        return _probe[label]


def _cached(source: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(source, filename), str)
    except Exception:  # noqa: BLE001 - an id the cache cannot even name is not cached
        return False


def hub_load_kwargs(source: str, field: str, where: str, filename: str = "config.json") -> dict:
    """Extra ``from_pretrained`` arguments for ``source`` so that it never waits on an unreachable hub.

    Args:
        source: A local folder or a hub id.
        field: The config field that names it ("model", "tokenizer"), for the error.
        where: Prefix naming the config entry, e.g. ``"policy 'qwen'"``.
        filename: A file every snapshot of such a repository has (``config.json`` for a
            model, ``tokenizer_config.json`` for a tokenizer), used to look the id up in
            the local cache.

    Returns:
        ``{}`` or ``{"local_files_only": True}`` (table in the module docstring).

    Raises:
        HubUnreachableError: the id is not cached and the hub cannot be reached, or
            ``HF_HUB_OFFLINE`` is set (names the field, the id and the fix).
    """
    if is_local_source(source):
        return {}
    cached = _cached(source, filename)
    offline = offline_mode()
    fix = (f"Download it once where there is network (`hf download {source}`) and copy the Hugging Face cache "
           f"here{'' if offline else ', then set HF_HUB_OFFLINE=1'}; or give {field}: a local folder written by "
           "save_pretrained.")
    if offline:
        if cached:
            return {}
        raise HubUnreachableError(f"{where}: {field}={source!r} is a hub id, HF_HUB_OFFLINE is set and it is not in "
                                  f"the local cache. {fix}")
    reachable, why = hub_reachable()
    if reachable:
        return {}
    if cached:
        return {"local_files_only": True}
    raise HubUnreachableError(f"{where}: {field}={source!r} is a hub id, and {why}; it is not in the local cache "
                              f"either. {fix}")


@contextmanager
def quiet_local_load(source: str) -> Iterator[None]:
    """Hide transformers' "Loading weights" progress bar while a *local folder* loads.

    For a tiny local model the bar finishes in milliseconds and only clutters the console;
    a hub id keeps every bar (downloads take real time). The previous state of both
    transformers' and huggingface_hub's progress-bar switches is restored afterwards, also
    when the load raises.

    Args:
        source: What ``from_pretrained`` is given (a folder or a hub id).
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    if not is_local_source(source) or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hub_was_disabled = are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        if hub_was_disabled:
            disable_progress_bars()
        elif are_progress_bars_disabled():
            enable_progress_bars()
