"""DeepSpeed profiles: the JSON configs in ``dsconfig/`` and the overlays that switch extras on.

This module is the one place that reads ``dsconfig/``: a profile is a ``*.json`` file there, named by
its stem (``zero2``), and everything else (the estimate, the CLI's choices, notebook 02's table, the
bench, the ranks' DeepSpeed config) asks :func:`profiles` or :func:`get_profile`, so a new file is a
new profile everywhere. ``TEXTSQL_DSCONFIG_DIR`` points at another directory of profiles.

A profile may also be given as a path to any DeepSpeed JSON. Overlays (``dsconfig/overlays/*.json``,
e.g. ``flops_profiler``) are merged on top, nested keys included. Batch size, accumulation, clipping,
learning rate and precision stay ``"auto"`` in the files: the HuggingFace trainer fills them from its
own arguments, so they are set in one place only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textsql.constants import ASSETS_DIR, DSCONFIG_DIR_VAR
from textsql.errors import ProfileError
from textsql.tracking.mlflow_free import import_deepspeed_lean

logger = logging.getLogger(__name__)

# The profiles: assets/dsconfig links to the checkout's dsconfig/, so a built wheel carries them as files
# (an installed package has no checkout beside it; tests/test_package.py runs `textsql estimate` from one).
DSCONFIG_DIR = (ASSETS_DIR / "dsconfig").resolve()

OVERLAY_SUBDIR = "overlays"
# The profile value that means "the estimate's recommendation" (the default of every run), here rather than
# in the estimate so that checking a profile name imports no torch.
AUTO_PROFILE = "auto"
ZERO_STAGES = (0, 1, 2, 3)
# Offload targets that move the states off the GPU ("none" keeps them there).
OFFLOAD_DEVICES = ("cpu", "nvme")
# Config sections the trainer's --precision fills while they say "auto".
PRECISION_KEYS = ("bf16", "fp16")
# Bytes per parameter in mixed-precision Adam training, DeepSpeed's own accounting (its estimators'
# 2 + 18): 16-bit parameters, 16-bit gradients, fp32 gradients, fp32 master parameters, fp32 Adam moments.
PARAM16_BYTES = 2
GRAD_BYTES = 2 + 4
OPTIMIZER_BYTES = 4 + 8
# DeepSpeed's estimators count fp32 weights per local rank, times this, in host memory while loading.
LOAD_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes the model states take under one profile: per rank on the GPU, per node in host memory."""

    gpu: float
    cpu: float
    estimator: str


@dataclass(frozen=True)
class Profile:
    """One DeepSpeed profile as its JSON file says: ZeRO stage, offload, precision, and its memory model.

    Usage::

        >>> profile = get_profile("zero3_offload")
        >>> (profile.stage, profile.offload_optimizer, profile.offload_params)
        (3, True, True)
    """

    name: str
    path: Path
    config: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def read(cls, path: Path) -> Profile:
        """Read and check one DeepSpeed JSON file.

        :raises ProfileError: the file is unreadable, not a JSON object, or names no valid ZeRO stage.
        :rtype: Profile
        """
        profile = cls(path.stem, path, _read(path))
        if profile.stage not in ZERO_STAGES:
            raise ProfileError(
                f"DeepSpeed config {str(path)!r} has zero_optimization.stage {profile.stage!r}; "
                f"set it to one of {', '.join(map(str, ZERO_STAGES))}"
            )
        return profile

    @property
    def stage(self) -> int:
        """The ZeRO stage (0 when the file has no ``zero_optimization``)."""
        return self.config.get("zero_optimization", {}).get("stage", 0)

    @property
    def offload_optimizer(self) -> bool:
        """Whether the optimizer states live in host memory (or NVMe) instead of the GPU."""
        return self._offloaded("offload_optimizer")

    @property
    def offload_params(self) -> bool:
        """Whether the parameters live in host memory (or NVMe) between uses (ZeRO-3)."""
        return self._offloaded("offload_param")

    @property
    def precision(self) -> dict[str, Any]:
        """``enabled`` of each precision section the file has (``"auto"``: set by ``--precision``)."""
        return {
            key: self.config[key].get("enabled", False)
            for key in PRECISION_KEYS
            if isinstance(self.config.get(key), dict)
        }

    @property
    def cost(self) -> tuple[int, bool, bool]:
        """Sort key, cheapest in communication and transfers first: stage, then offload."""
        return self.stage, self.offload_optimizer, self.offload_params

    def check_precision(self, precision: str) -> None:
        """Refuse a precision this file fixes otherwise (DeepSpeed would fail it on every rank, later).

        :param precision: the resolved precision, ``bf16``, ``fp16`` or ``fp32``.
        :raises ProfileError: when a section's ``enabled`` is fixed and disagrees with ``precision``.
        """
        for key, enabled in self.precision.items():
            if enabled != "auto" and bool(enabled) != (precision == key):
                raise ProfileError(
                    f"profile {self.name!r} fixes {key}.enabled to {json.dumps(enabled)} but the run uses {precision}; "
                    f'set it to "auto" in {str(self.path)!r} or pass --precision {key if enabled else "fp32"}'
                )

    def memory(self, total: int, largest: int, nodes: int, gpus_per_node: int) -> ModelStateMemory:
        """Model-state memory under this profile, from DeepSpeed's estimators where it has them.

        DeepSpeed has estimators for ZeRO-2 (and the optimizer offload of stages 1 and 2) and ZeRO-3;
        below that every rank holds everything (stage 0), or only the optimizer side (fp32 gradients,
        master weights, moments) is split across ranks (stage 1).

        :param total: parameter count.
        :param largest: parameters of the largest module (ZeRO-3 gathers one at a time).
        :rtype: ModelStateMemory
        """
        import_deepspeed_lean()
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        offload = " (cpu offload)" if self.offload_optimizer else ""
        if self.stage == 3:
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                total,
                largest,
                gpus_per_node,
                nodes,
                cpu_offload=self.offload_optimizer,
                cpu_offload_params=self.offload_params,
            )
            return ModelStateMemory(gpu, cpu, f"deepspeed estimate_zero3_model_states_mem_needs{offload}")
        if self.stage == 2 or self.offload_optimizer:
            cpu, gpu = estimate_zero2_model_states_mem_needs(
                total, gpus_per_node, nodes, cpu_offload=self.offload_optimizer
            )
            return ModelStateMemory(gpu, cpu, f"deepspeed estimate_zero2_model_states_mem_needs{offload}")
        cpu = total * 4 * gpus_per_node * LOAD_BUFFER_FACTOR
        if self.stage == 1:
            ranks = nodes * gpus_per_node
            gpu = total * (PARAM16_BYTES + 2) + total * (4 + OPTIMIZER_BYTES) // ranks
            return ModelStateMemory(gpu, cpu, "2+18 bytes/parameter, optimizer states sharded")
        return ModelStateMemory(
            total * (PARAM16_BYTES + GRAD_BYTES + OPTIMIZER_BYTES), cpu, "2+18 bytes/parameter, nothing sharded"
        )

    def _offloaded(self, key: str) -> bool:
        return self.config.get("zero_optimization", {}).get(key, {}).get("device", "none") in OFFLOAD_DEVICES


def dsconfig_dir() -> Path:
    """The directory of profiles: ``$TEXTSQL_DSCONFIG_DIR`` when set, else the project's ``dsconfig/``.

    :rtype: pathlib.Path
    """
    return Path(os.environ.get(DSCONFIG_DIR_VAR) or DSCONFIG_DIR).expanduser()


def profiles(names: Iterable[str | Path] | None = None) -> list[Profile]:
    """Every profile in :func:`dsconfig_dir`, or only the ones named, cheapest first (what ``textsql estimate`` walks).

    :param names: profile names or DeepSpeed JSON paths (default: every ``*.json`` in :func:`dsconfig_dir`).
    :raises ProfileError: an unknown name, or a broken file; the message names it.
    :rtype: list[Profile]
    """
    if names is None:
        found = [Profile.read(path) for path in dsconfig_dir().glob("*.json")]
    else:
        found = [get_profile(name) for name in dict.fromkeys(names)]
    return sorted(found, key=lambda profile: (profile.cost, profile.name))


def available_profiles() -> list[str]:
    """Names of the profiles in :func:`dsconfig_dir`, cheapest first.

    :rtype: list[str]
    """
    return [profile.name for profile in profiles()]


def available_overlays() -> list[str]:
    """Names of the overlays in ``dsconfig/overlays/``.

    :rtype: list[str]
    """
    return sorted(path.stem for path in (dsconfig_dir() / OVERLAY_SUBDIR).glob("*.json"))


def get_profile(name_or_path: str | Path) -> Profile:
    """The profile called ``name_or_path`` (``zero3``), or the one in that DeepSpeed JSON file.

    :raises ProfileError: neither a profile name nor a readable DeepSpeed file; the message lists the names.
    :rtype: Profile
    """
    return Profile.read(profile_path(name_or_path))


def run_profile(name_or_path: str | Path, flag: str = "--profile") -> Profile | None:
    """The profile a run names: None for :data:`AUTO_PROFILE` (the estimate picks one later), else the profile.

    :param name_or_path: ``auto``, a profile's name or a DeepSpeed JSON file.
    :param flag: how the command that took it spells it (``--profile``; ``-p profile=`` for ``textsql demo``), for
        the refusal.
    :raises ProfileError: neither ``auto``, a profile name nor a readable DeepSpeed file, in the command's words.
    :rtype: Profile | None
    """
    if str(name_or_path) == AUTO_PROFILE:
        return None
    path = _resolve(name_or_path, dsconfig_dir(), available_profiles(), "profile", flag, also=(AUTO_PROFILE,))
    return Profile.read(path)


def profile_path(name_or_path: str | Path) -> Path:
    """Resolve a profile name (``zero3``) or a path to a DeepSpeed JSON file.

    :raises ProfileError: when it is neither a profile in :func:`dsconfig_dir` nor an existing file.
    :rtype: pathlib.Path
    """
    return _resolve(name_or_path, dsconfig_dir(), available_profiles(), "profile", "--profile")


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
    """A profile's DeepSpeed config with the given overlays (names from ``dsconfig/overlays`` or paths) on top.

    Usage::

        >>> load_profile("zero3", ["flops_profiler"])["flops_profiler"]["enabled"]
        True

    :param name_or_path: a profile name from :func:`available_profiles` or a JSON file path.
    :param overlays: overlay names or JSON file paths, applied in order.
    :raises ProfileError: unknown name, missing file, or a file that is not a valid profile.
    :rtype: dict
    """
    config = get_profile(name_or_path).config
    directory = dsconfig_dir() / OVERLAY_SUBDIR
    for overlay in overlays:
        config = merge(config, _read(_resolve(overlay, directory, available_overlays(), "overlay", "--overlay")))
    return config


def _resolve(
    name_or_path: str | Path, directory: Path, names: list[str], kind: str, flag: str, also: Sequence[str] = ()
) -> Path:
    """The file of a name in ``names`` or a DeepSpeed file's path; refused naming ``flag``, ``also`` (values the
    command takes besides the names) and the names."""
    text = str(name_or_path)
    if text in names:
        return directory / f"{text}.json"
    path = Path(text).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path.resolve()
    raise ProfileError(
        f"unknown {kind} {text!r}; pass {flag} one of {', '.join([*also, *names])} or a path to a DeepSpeed .json file"
    )


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ProfileError(
            f"cannot read DeepSpeed config {str(path)!r}: {error}; fix the file or pick another profile"
        ) from None
    if not isinstance(config, dict):
        raise ProfileError(f"DeepSpeed config {str(path)!r} is not a JSON object; fix the file or pick another profile")
    return config


def autocast_bf16(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The config a bf16 run uses: at stage 0 with the trainer's own optimizer, torch autocast instead of
    DeepSpeed's bf16 weights; whether the trainer's optimizer must then clip the gradients itself.

    DeepSpeed wraps a non-DeepSpeed optimizer at stage 0 in bf16 in ``FP16_UnfusedOptimizer``
    (``engine._do_optimizer_sanity_check``: ``DDP_BFLOAT16``), which checks overflow and takes norms
    tensor by tensor, each with a host read: hundreds of ops and a sync per tensor every step. Under
    ``torch_autocast`` the weights stay fp32, the forward runs in bf16, and the engine steps the fused
    optimizer itself, unwrapped. DeepSpeed's own clipping (``clip_fp32_gradients``) also loops per tensor,
    so the run gives DeepSpeed a clipping of 0 and the optimizer clips by a foreach norm before each step
    instead (``textsql.training.train``, :mod:`textsql.training.clipping`).
    Other stages, and profiles that name a DeepSpeed optimizer, keep DeepSpeed's bf16.

    :returns: ``(config, clip_in_optimizer)``; the input config is left alone.
    :rtype: tuple[dict, bool]
    """
    if config.get("zero_optimization", {}).get("stage", 0) != 0 or "optimizer" in config:
        return config, False
    lean = {key: value for key, value in config.items() if key not in ("bf16", "fp16")}
    lean["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return lean, True
