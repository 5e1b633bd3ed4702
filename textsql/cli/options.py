"""Option machinery the command modules share: options built from the arguments dataclasses, and the DeepSpeed
profile as a click type.

A command's option whose dataclass field already says what it means takes its help and default from there,
so the command line and the Python API cannot say different things.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING
from typing import Any

import click

from textsql.arguments import argument_field, kebab_flag
from textsql.errors import ProfileError
from textsql.training.profiles import available_profiles, profile_path


class ProfileType(click.ParamType):
    """A DeepSpeed profile: a name from ``dsconfig/``, read when the command runs (a new file is a new
    choice at once), or a path to a DeepSpeed ``.json`` file."""

    name = "profile"

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return f"[{'|'.join(available_profiles())}|FILE.json]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            profile_path(value)
        except ProfileError as error:
            self.fail(str(error), param, ctx)
        return str(value)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
        return [
            click.shell_completion.CompletionItem(name) for name in available_profiles() if name.startswith(incomplete)
        ]


def field_option(cls: type, name: str, flag: str | None = None, **attrs: Any) -> Callable[..., Any]:
    """``--the-name`` for the field ``name`` of an arguments dataclass, its help and default taken from the
    field, so the CLI and the dataclass cannot say different things; a boolean field is a ``--x/--no-x``
    flag. ``flag`` names the option where the field's name would mean something else on the command line
    (the function then gets it under the flag's name); ``attrs`` add click's type and the like.

    :rtype: typing.Callable
    """
    spec = argument_field(cls, name)
    flag = flag or kebab_flag(name)
    attrs.setdefault("help", spec.metadata["help"])
    if spec.default is not MISSING:
        attrs.setdefault("default", spec.default)
        attrs.setdefault("show_default", spec.default not in (None, False))
    elif spec.default_factory is MISSING:
        attrs.setdefault("required", True)
    if spec.type in (bool, "bool"):
        return click.option(f"{flag}/--no-{flag[2:]}", flag[2:].replace("-", "_"), **attrs)
    return click.option(flag, flag[2:].replace("-", "_"), **attrs)


def notebook_parameter_option(help: str) -> Callable[..., Any]:
    """``-p/--parameter [NOTEBOOK.]NAME=VALUE``, repeatable: a notebook parameter, as the pipeline's commands take it.

    :param help: the option's help, which says what the command does with the parameters.
    :rtype: typing.Callable
    """
    return click.option("-p", "--parameter", "parameters", multiple=True, metavar="[NOTEBOOK.]NAME=VALUE", help=help)
