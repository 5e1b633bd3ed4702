"""What a worker reports about itself, and the checks every field passes before the master uses it."""

from __future__ import annotations

import base64
import binascii
import getpass
import ipaddress
import logging
import re
import socket
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worker.constants import MAX_SLOTS, SSH_KEY_TYPES
from worker.errors import RendezvousError
from worker.inventory import InvalidInventory, Inventory

logger = logging.getLogger(__name__)

_HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*"
)
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_POD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}")
_MAX_KEY_CHARS = 4096
# Only digits, hex letters, ':' and '.': no scope id ('%') and nothing OpenSSH reads as a pattern
# (`*?!,[]`, whitespace), so a known_hosts or ssh_config entry names this one host and no other.
_PLAIN_ADDRESS = re.compile(r"[0-9A-Fa-f:.]{2,45}")


class InvalidRegistration(RendezvousError):
    """A registration field failed validation; the message names the field."""


def check_address(value: object) -> str:
    """The address in canonical form, if it is a unicast IPv4/IPv6 address a worker can listen on.

    :param value: what the worker sent.
    :rtype: str
    """
    try:
        if not isinstance(value, str) or not _PLAIN_ADDRESS.fullmatch(value):
            raise ValueError(value)
        address = ipaddress.ip_address(value)
    except ValueError:
        raise InvalidRegistration(
            f"address {value!r} is not an IP address (plain, with no scope id); pass --address with the pod's IP"
        ) from None
    if address.is_unspecified or address.is_multicast:
        raise InvalidRegistration(f"address {value!r} cannot be reached; pass the pod's own IP")
    return str(address)


def node_order(registration: Registration) -> tuple[int, int]:
    """Sort key giving node-rank order: IPv4 before IPv6, then by numeric address.

    Comparing ``IPv4Address`` with ``IPv6Address`` raises TypeError, so mixed families need a key.

    :param registration: a validated registration.
    :rtype: tuple[int, int]
    """
    address = ipaddress.ip_address(registration.address)
    return address.version, int(address)


def check_slots(value: object) -> int:
    """Slot count (GPUs on the worker; 1 without GPUs).

    :param value: what the worker sent.
    :rtype: int
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        raise InvalidRegistration(f"slots {value!r} must be an integer from 1 to {MAX_SLOTS}; pass --slots")
    return value


def check_port(value: object) -> int:
    """A TCP port, 1..65535.

    :param value: what the worker sent.
    :rtype: int
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise InvalidRegistration(f"ssh port {value!r} must be an integer from 1 to 65535; pass --ssh-port")
    return value


def check_hostname(value: object) -> str:
    """A DNS-style hostname (letters, digits, ``-``, ``_``, dots).

    :param value: what the worker sent.
    :rtype: str
    """
    return _matching(value, _HOSTNAME, "hostname {!r} is not a valid hostname")


def check_host_key(value: object) -> str:
    """An OpenSSH public key line ``TYPE BASE64 [comment]``, returned as ``TYPE BASE64``.

    The base64 blob must decode and start with the same key type, as in a real key.

    :param value: what the worker sent.
    :rtype: str
    """
    if not isinstance(value, str) or len(value) > _MAX_KEY_CHARS or "\n" in value or "\r" in value:
        raise InvalidRegistration("ssh host key must be one line 'TYPE BASE64' from the worker's sshd")
    fields = value.split()
    if len(fields) < 2 or fields[0] not in SSH_KEY_TYPES:
        raise InvalidRegistration(
            f"ssh host key type {fields[0] if fields else ''!r} is not one of {', '.join(SSH_KEY_TYPES)}"
        )
    key_type, blob = fields[0], fields[1]
    try:
        raw = base64.b64decode(blob, validate=True)
        (length,) = struct.unpack(">I", raw[:4])
        embedded = raw[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        raise InvalidRegistration("ssh host key blob is not a valid OpenSSH public key") from None
    if embedded != key_type:
        raise InvalidRegistration(f"ssh host key blob holds a {embedded!r} key but says {key_type!r}")
    return f"{key_type} {blob}"


def check_user(value: object) -> str:
    """A POSIX login name.

    :param value: what the worker sent.
    :rtype: str
    """
    return _matching(value, _USER, "user {!r} is not a valid login name")


def check_pod(value: object) -> str:
    """The platform's name or id for the worker (CML engine id, pod name, local-N).

    :param value: what the worker sent.
    :rtype: str
    """
    return _matching(value, _POD, "pod {!r} is not a valid pod name or id")


def _matching(value: object, pattern: re.Pattern[str], problem: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise InvalidRegistration(problem.format(value))
    return value


@dataclass(frozen=True)
class Registration:
    """One worker, as it registered.

    ``ssh_port`` and ``host_key`` come together or not at all: a register-only worker (no sshd,
    used by benchmarks) goes in the hostfile but not in known_hosts or ssh_config.
    """

    address: str
    slots: int
    hostname: str
    pod: str
    ssh_port: int | None = None
    host_key: str | None = None
    user: str | None = None
    # What the master judges the cluster by (versions, accelerators, interface, disk); None from older agents.
    inventory: Inventory | None = None

    @classmethod
    def from_dict(cls, data: object) -> Registration:
        """Validate every field of a received registration.

        :param data: the ``worker`` object of a register message.
        :rtype: Registration
        :raises InvalidRegistration: naming the first bad field.
        """
        if not isinstance(data, dict):
            raise InvalidRegistration("registration must be a JSON object")
        unknown = sorted(set(data) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise InvalidRegistration(f"unknown registration field {unknown[0]!r}")
        for required in ("address", "slots", "hostname"):
            if required not in data:
                raise InvalidRegistration(f"registration lacks {required!r}")
        if (data.get("ssh_port") is None) != (data.get("host_key") is None):
            raise InvalidRegistration("ssh_port and host_key go together; pass both or neither")
        hostname = check_hostname(data["hostname"])
        return cls(
            address=check_address(data["address"]),
            slots=check_slots(data["slots"]),
            hostname=hostname,
            pod=check_pod(data.get("pod", hostname)),
            ssh_port=None if data.get("ssh_port") is None else check_port(data["ssh_port"]),
            host_key=None if data.get("host_key") is None else check_host_key(data["host_key"]),
            user=None if data.get("user") is None else check_user(data["user"]),
            inventory=_inventory(data.get("inventory")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The registration as sent on the wire (None fields left out).

        :rtype: dict
        """
        return {key: value for key, value in asdict(self).items() if value is not None}


def _inventory(value: object) -> Inventory | None:
    try:
        return None if value is None else Inventory.from_dict(value)
    except InvalidInventory as error:
        raise InvalidRegistration(str(error)) from None


def default_pod(address: str) -> str:
    """A worker's name when the platform gives none: its address, prefixed where a pod name cannot start
    with it (``::1`` becomes ``ipv6-::1``).

    :param address: the worker's address.
    :rtype: str
    """
    return address if address[:1].isalnum() else f"ipv6-{address}"


def registration_from_options(
    address: str, slots: int, ssh_port: int | None = None, ssh_host_key_file: str | None = None, pod: str | None = None
) -> Registration:
    """A registration for this host from command-line values (``textsql rendezvous register``).

    :param address: the worker's address.
    :param slots: its slot count.
    :param ssh_port: its sshd port (with ``ssh_host_key_file``).
    :param ssh_host_key_file: its sshd host public key file.
    :param pod: the platform's name for this worker (default: :func:`default_pod` of its address).
    :rtype: Registration
    """
    if (ssh_port is None) != (ssh_host_key_file is None):
        raise InvalidRegistration("--ssh-port and --ssh-host-key-file go together; pass both or neither")
    host_key = Path(ssh_host_key_file).read_text(encoding="utf-8").strip() if ssh_host_key_file else None
    return Registration.from_dict(
        {
            "address": address,
            "slots": slots,
            "hostname": socket.gethostname(),
            "pod": pod or default_pod(address),
            "ssh_port": ssh_port,
            "host_key": host_key,
            "user": getpass.getuser(),
        }
    )
