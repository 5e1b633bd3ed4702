"""DeepSpeed profiles: the JSON configs in ``dsconfig/`` and the overlays that switch extras on.

A profile is named by its file stem (``zero2``) or given as a path to any DeepSpeed JSON. Overlays
(``dsconfig/overlays/*.json``, e.g. ``flops_profiler``) are merged on top, nested keys included.
Batch size, accumulation, clipping, learning rate and precision stay ``"auto"`` in the files: the
HuggingFace trainer fills them from its own arguments, so they are set in one place only.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from textsql.constants import DSCONFIG_DIR
from textsql.errors import ProfileError

logger = logging.getLogger(__name__)

OVERLAY_DIR = DSCONFIG_DIR / "overlays"
# Cheapest first: what `textsql estimate` walks when it recommends one.
PROFILE_ORDER = ("zero0", "zero1", "zero2", "zero3", "zero3_offload")


def available_profiles(directory: Path = DSCONFIG_DIR) -> list[str]:
    """Names of the profiles shipped in ``dsconfig/``, cheapest first.

    :param directory: where the profile files live.
    :rtype: list[str]
    """
    names = {path.stem for path in directory.glob("*.json")}
    return [name for name in PROFILE_ORDER if name in names] + sorted(names - set(PROFILE_ORDER))


def available_overlays(directory: Path = OVERLAY_DIR) -> list[str]:
    """Names of the overlays shipped in ``dsconfig/overlays/``.

    :rtype: list[str]
    """
    return sorted(path.stem for path in directory.glob("*.json"))


def profile_path(name_or_path: str | Path) -> Path:
    """Resolve a profile name (``zero3``) or a path to a DeepSpeed JSON file.

    :raises ProfileError: when it is neither a shipped profile nor an existing file.
    :rtype: pathlib.Path
    """
    return _resolve(name_or_path, DSCONFIG_DIR, available_profiles(), "profile", "--profile")


def merge(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``base`` with ``overlay`` merged in: nested dicts merge key by key, other values replace.

    Usage::

        >>> merge({"zero_optimization": {"stage": 3, "overlap_comm": True}}, {"zero_optimization": {"stage": 2}})
        {'zero_optimization': {'stage': 2, 'overlap_comm': True}}

    :rtype: dict
    """
    merged = dict(base)
    for key, value in overlay.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_profile(name_or_path: str | Path, overlays: Iterable[str | Path] = ()) -> dict[str, Any]:
    """Load a profile and merge the given overlays (names from ``dsconfig/overlays`` or paths) on top.

    Usage::

        >>> load_profile("zero3", ["flops_profiler"])["flops_profiler"]["enabled"]
        True

    :param name_or_path: a profile name from :func:`available_profiles` or a JSON file path.
    :param overlays: overlay names or JSON file paths, applied in order.
    :raises ProfileError: unknown name, missing file, or a file that is not a JSON object.
    :rtype: dict
    """
    config = _read(profile_path(name_or_path))
    for overlay in overlays:
        path = _resolve(overlay, OVERLAY_DIR, available_overlays(), "overlay", "--overlay")
        config = merge(config, _read(path))
    return config


def _resolve(name_or_path: str | Path, directory: Path, names: list[str], kind: str, flag: str) -> Path:
    text = str(name_or_path)
    if text in names:
        return directory / f"{text}.json"
    path = Path(text).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path.resolve()
    raise ProfileError(f"unknown {kind} {text!r}; pass {flag} one of {', '.join(names)} or a path to a DeepSpeed .json file")


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ProfileError(f"cannot read DeepSpeed config {str(path)!r}: {error}; fix the file or pick another profile") from None
    if not isinstance(config, dict):
        raise ProfileError(f"DeepSpeed config {str(path)!r} is not a JSON object; fix the file or pick another profile")
    return config
