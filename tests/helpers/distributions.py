"""Installed distributions and requirements files, read the way pip reads them: for the tests that check what a
GPU machine without network is given to install."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def pins(path: Path) -> dict[str, str]:
    """``name: version`` of a requirements file's ``name==version`` lines."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {
        canonicalize_name(name): version
        for name, _, version in (line.partition("==") for line in lines if "==" in line)
    }


def requirements_of(name: str) -> list[Requirement]:
    """The installed distribution ``name``'s requirements that apply without extras."""
    requirements = (Requirement(line) for line in importlib.metadata.distribution(name).requires or [])
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def needs(names: Iterable[str]) -> dict[str, str]:
    """``name: installed version`` of ``names`` and everything they need."""
    found: dict[str, str] = {}
    waiting = list(names)
    while waiting:
        name = canonicalize_name(waiting.pop())
        if name not in found:
            found[name] = importlib.metadata.version(name)
            waiting += [requirement.name for requirement in requirements_of(name)]
    return found


def bounded_beyond_torch(carried: set[str]) -> set[str]:
    """What torch brings that a ``carried`` package bounds beyond torch's own requirement: an upper bound, or a
    lower one that the oldest version torch accepts (its ``>=``, else any) fails. An image's copy may be that old
    (or newer than the bound), and pip, offered only the carried folder, could not change it."""
    brought = needs(["torch"]).keys() - {"torch"}
    floors = {}
    for owner in needs(["torch"]):
        for requirement in requirements_of(owner):
            floors[canonicalize_name(requirement.name)] = next(
                (spec.version for spec in requirement.specifier if spec.operator == ">="), None
            )
    bounded = set()
    for name in carried:
        for requirement in requirements_of(name):
            other = canonicalize_name(requirement.name)
            if other not in brought or not requirement.specifier:
                continue
            floor = floors.get(other)
            upper = any(spec.operator in ("<", "<=", "==", "~=") for spec in requirement.specifier)
            if upper or floor is None or floor not in requirement.specifier:
                bounded.add(other)
    return bounded
