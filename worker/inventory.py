"""What a host has for training, as a worker reports it over the rendezvous and the master reads its own.

Versions of Python, torch (and the CUDA it was built for), DeepSpeed, transformers and this project; the
accelerators (count, model, memory, compute capability, or none); the network interface that carries the
host's address; the free disk where checkpoints go. Everything is read without importing torch or any of
the training stack (package metadata, ``torch/version.py``, ``nvidia-smi``), so an agent stays light.

The master checks a received inventory like every registration field (:meth:`Inventory.from_dict`: known
fields only, bounded strings and numbers); ``textsql.launching.cluster_check`` judges the cluster from it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import ipaddress
import json
import logging
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import psutil

from worker.constants import MAX_SLOTS
from worker.errors import RendezvousError

logger = logging.getLogger(__name__)

# The distributions whose versions must agree across hosts, by their field name (CUDA is torch's build).
PACKAGES = {"torch": "torch", "deepspeed": "deepspeed", "transformers": "transformers", "textsql": "textsql"}
VERSION_FIELDS = ("python", "torch", "cuda", "deepspeed", "transformers", "textsql")
NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
NVIDIA_SMI_TIMEOUT_S = 30
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_-]{0,63}")
_MODEL = re.compile(r"[0-9A-Za-z][0-9A-Za-z .()_/-]{0,127}")
_CAPABILITY = re.compile(r"\d{1,2}\.\d{1,2}")
# Linux interface names: at most 15 characters (IFNAMSIZ), no '/', no whitespace.
_INTERFACE = re.compile(r"[0-9A-Za-z_.:@-]{1,15}")
_MAX_MEMORY_MIB = 1 << 30
_MAX_DISK_BYTES = 1 << 62


class InvalidInventory(RendezvousError):
    """An inventory field failed validation; the message names the field."""


@dataclass(frozen=True)
class Inventory:
    """One host's software, accelerators, network interface and free disk (None: not found there)."""

    python: str
    torch: str | None = None
    cuda: str | None = None
    deepspeed: str | None = None
    transformers: str | None = None
    textsql: str | None = None
    accelerators: int = 0
    accelerator_model: str | None = None
    accelerator_memory_mib: int | None = None
    accelerator_capability: str | None = None
    interface: str | None = None
    free_disk_bytes: int | None = None

    @classmethod
    def from_dict(cls, data: object) -> Inventory:
        """Validate every field of a received inventory.

        :param data: the ``inventory`` object of a registration.
        :rtype: Inventory
        :raises InvalidInventory: naming the first bad field.
        """
        if not isinstance(data, dict):
            raise InvalidInventory("inventory must be a JSON object")
        unknown = sorted(set(data) - {spec.name for spec in fields(cls)})
        if unknown:
            raise InvalidInventory(f"unknown inventory field {unknown[0]!r}")
        if "python" not in data:
            raise InvalidInventory("inventory lacks 'python'")
        checked: dict[str, Any] = {name: _optional(data.get(name), _VERSION, name) for name in VERSION_FIELDS}
        if checked["python"] is None:
            raise InvalidInventory("inventory field 'python' must be a version")
        return cls(
            **checked,
            accelerators=_count(data.get("accelerators", 0), "accelerators", MAX_SLOTS),
            accelerator_model=_optional(data.get("accelerator_model"), _MODEL, "accelerator_model"),
            accelerator_memory_mib=_optional_count(data.get("accelerator_memory_mib"), "accelerator_memory_mib"),
            accelerator_capability=_optional(data.get("accelerator_capability"), _CAPABILITY, "accelerator_capability"),
            interface=_optional(data.get("interface"), _INTERFACE, "interface"),
            free_disk_bytes=_optional_count(data.get("free_disk_bytes"), "free_disk_bytes", _MAX_DISK_BYTES),
        )

    def to_dict(self) -> dict[str, Any]:
        """The inventory as sent on the wire (None fields left out).

        :rtype: dict
        """
        return {key: value for key, value in asdict(self).items() if value is not None}

    def versions(self) -> dict[str, str | None]:
        """The versions that must agree across hosts, by name.

        :rtype: dict[str, str | None]
        """
        return {name: getattr(self, name) for name in VERSION_FIELDS}


def _optional(value: object, pattern: re.Pattern[str], name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidInventory(f"inventory field {name!r} has an unexpected value {str(value)[:80]!r}")
    return value


def _count(value: object, name: str, most: int = _MAX_MEMORY_MIB) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise InvalidInventory(f"inventory field {name!r} must be an integer from 0 to {most}")
    return value


def _optional_count(value: object, name: str, most: int = _MAX_MEMORY_MIB) -> int | None:
    return None if value is None else _count(value, name, most)


def collect(address: str | None, disk_path: str | Path, overrides: Mapping[str, object] | None = None) -> Inventory:
    """This host's inventory.

    :param address: the address this host registers with (its interface is looked up), or None.
    :param disk_path: where checkpoints go; the free space of the file system holding it (or its nearest
        existing parent) is reported.
    :param overrides: fields to report instead of what was found (tests pretend to be another host with
        them, through :func:`overrides_for`).
    :rtype: Inventory
    """
    found = {
        "python": platform.python_version(),
        **{name: package_version(distribution) for name, distribution in PACKAGES.items()},
        "cuda": torch_cuda_version(),
        **accelerators(),
        "interface": interface_of(address) if address else None,
        "free_disk_bytes": free_disk_bytes(Path(disk_path)),
    }
    return Inventory.from_dict({**found, **(overrides or {})})


def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None when it is not installed.

    :rtype: str | None
    """
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built for (``torch.version.cuda``), read from its ``version.py`` without
    importing torch (seconds of start-up); None for a CPU build or without torch.

    :rtype: str | None
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(version_file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for statement in tree.body:
        if not isinstance(statement, ast.Assign | ast.AnnAssign) or not isinstance(statement.value, ast.Constant):
            continue
        target = statement.target if isinstance(statement, ast.AnnAssign) else statement.targets[0]
        if isinstance(target, ast.Name) and target.id == "cuda":
            return statement.value.value if isinstance(statement.value.value, str) else None
    return None


def accelerators() -> dict[str, object]:
    """NVIDIA GPUs as ``nvidia-smi`` lists them: count, and the first one's model, memory and capability.

    :rtype: dict
    """
    try:
        listing = subprocess.run(
            NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {"accelerators": 0}
    rows = [[cell.strip() for cell in line.split(",")] for line in listing.splitlines() if line.strip()]
    if not rows or len(rows[0]) != 3:
        return {"accelerators": 0}
    name, memory, capability = rows[0]
    return {
        "accelerators": len(rows),
        "accelerator_model": name,
        "accelerator_memory_mib": int(memory) if memory.isdigit() else None,
        "accelerator_capability": capability if _CAPABILITY.fullmatch(capability) else None,
    }


def interface_of(address: str) -> str | None:
    """The network interface that carries ``address``: the one holding it, else the one whose network
    contains it (127.0.0.2 is on ``lo``, which holds 127.0.0.1/8).

    :rtype: str | None
    """
    wanted = ipaddress.ip_address(address)
    containing = None
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            try:
                own = ipaddress.ip_address(entry.address.split("%")[0])
            except ValueError:
                continue  # a link-layer address
            if own == wanted:
                return str(name)
            if entry.netmask and own.version == wanted.version and containing is None:
                network = ipaddress.ip_network(f"{own}/{entry.netmask}", strict=False)
                if wanted in network:
                    containing = name
    return containing


def free_disk_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` or, while it does not exist yet, its nearest parent.

    :rtype: int | None
    """
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def overrides_for(pod: str, text: str | None) -> dict[str, object]:
    """The fields a test wants pod ``pod`` to report instead of its own: ``text`` is a JSON object of
    pod name (or ``*`` for every pod) to fields, e.g. ``{"local-1": {"torch": "2.0.0"}}``.

    :param pod: this worker's pod name.
    :param text: the variable's value (None: no overrides).
    :rtype: dict
    """
    if not text:
        return {}
    try:
        by_pod = json.loads(text)
    except ValueError:
        raise InvalidInventory(f"inventory overrides {text[:80]!r} are not a JSON object of pod -> fields") from None
    if not isinstance(by_pod, dict) or not all(isinstance(value, dict) for value in by_pod.values()):
        raise InvalidInventory("inventory overrides must be a JSON object of pod -> {field: value}")
    return {**by_pod.get("*", {}), **by_pod.get(pod, {})}
