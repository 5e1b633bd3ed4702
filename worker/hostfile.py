"""DeepSpeed hostfiles: one ``HOST slots=N`` line per worker.

The format is the one ``deepspeed.launcher.runner._parse_hostfile`` reads (``^(\\S+)\\s+slots=(\\d+)``,
``#`` comments and blank lines skipped, duplicates refused). This parser is stricter where
DeepSpeed is lax (trailing text after ``slots=N``, zero slots) so a file that passes here also
passes there; tests check the round trip against DeepSpeed's own parser.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

from worker.constants import MAX_SLOTS
from worker.errors import HostfileError
from worker.files import atomic_write

logger = logging.getLogger(__name__)

_LINE = re.compile(r"(\S+)\s+slots=(\d+)")


def format_hostfile(entries: Iterable[tuple[str, int]]) -> str:
    """Hostfile text for ``(host, slots)`` pairs, in the given order (the order is node rank).

    :param entries: host and slot count of each worker.
    :rtype: str
    :raises HostfileError: on no entries, a duplicate host, a host with whitespace or bad slots.
    """
    lines = []
    seen = set()
    for host, slots in entries:
        if not host or re.search(r"\s|#", host):
            raise HostfileError(f"host {host!r} cannot go in a hostfile; use an address or hostname")
        if host in seen:
            raise HostfileError(f"host {host!r} appears twice; each worker needs its own address")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise HostfileError(f"slots {slots!r} for {host!r} must be an integer from 1 to {MAX_SLOTS}")
        seen.add(host)
        lines.append(f"{host} slots={slots}\n")
    if not lines:
        raise HostfileError("no workers to write into the hostfile; start at least one worker")
    return "".join(lines)


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` in file order from hostfile text.

    :param text: the hostfile's content.
    :param source: what to call it in errors (usually its path).
    :rtype: dict[str, int]
    :raises HostfileError: on a bad line, zero slots, a duplicate host or no hosts at all.
    """
    pool: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if not match:
            raise HostfileError(f"{source}:{number}: bad line {line!r}; expected 'HOST slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise HostfileError(f"{source}:{number}: {host!r} has {slots} slots; give it at least 1")
        if host in pool:
            raise HostfileError(f"{source}:{number}: {host!r} appears twice; list each host once")
        pool[host] = slots
    if not pool:
        raise HostfileError(f"{source} lists no hosts; add lines like '10.0.0.5 slots=8'")
    return pool


def write_hostfile(path: Path, entries: Iterable[tuple[str, int]]) -> Path:
    """Write a hostfile atomically.

    :param path: where to write it.
    :param entries: host and slot count of each worker, in node-rank order.
    :rtype: pathlib.Path
    """
    return atomic_write(Path(path), format_hostfile(entries), mode=0o600)


def read_hostfile(path: Path) -> dict[str, int]:
    """``{host: slots}`` from a hostfile on disk.

    :param path: the hostfile.
    :rtype: dict[str, int]
    :raises HostfileError: if it is missing or malformed.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HostfileError(f"hostfile {str(path)!r} does not exist; start the workers first") from None
    return parse_hostfile(text, source=str(path))
