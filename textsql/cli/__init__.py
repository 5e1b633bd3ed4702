"""The ``textsql`` command line: one click group, ``cli``, whose commands call the package's stages.

``commands`` defines the group and its commands, ``help`` the help's sections and pipeline order.
"""

from textsql.cli.commands import cli

__all__ = ["cli"]
