"""This rank's world, as DeepSpeed's launcher tells it: how many ranks the run has, and how many share this node.

A rank's plan depends on it in several places (the profile's memory estimate, the recipe's tokens a step, whether a
checkpoint needs its universal conversion, the CPU threads a rank takes), and each reads it here. The launching
machine, outside any launch, is a world of one.

Usage::

    >>> world_size(), ranks_on_this_node()
    (1, 1)
"""

from __future__ import annotations

import os


def world_size() -> int:
    """The ranks of the whole run: the launcher's ``WORLD_SIZE``.

    :rtype: int
    """
    return int(os.environ.get("WORLD_SIZE", "1"))


def ranks_on_this_node() -> int:
    """The ranks sharing this node: DeepSpeed's per-node launcher sets ``LOCAL_SIZE``, a lone ``textsql train``
    torch's ``LOCAL_WORLD_SIZE``.

    :rtype: int
    """
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
