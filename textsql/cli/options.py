"""Option machinery the command modules share: options built from the arguments dataclasses, the DeepSpeed
profile as a click type, and the spellings of the previous release, refused with the new one.

A command's option whose dataclass field already says what it means takes its help and default from there,
so the command line and the Python API cannot say different things.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING
from typing import Any

import click
from click.core import ParameterSource

from textsql.arguments import argument_field, kebab_flag
from textsql.errors import ProfileError
from textsql.planning.profiles import available_profiles, profile_path


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
    return click.option("-p", "--parameter", multiple=True, metavar="[NOTEBOOK.]NAME=VALUE", help=help)


def renamed_option(old: str, new: str, usage: str) -> Callable[..., Any]:
    """``old``, an option of the previous release, refused with a usage error (exit 2) that names ``new``; its
    ``TEXTSQL_<COMMAND>_<OLD>`` variable is refused the same way. Hidden from --help. For one release.

    :param old: the old flag, e.g. ``--out``.
    :param new: the flag that replaced it, e.g. ``--run-dir``.
    :param usage: the command written with the new flag, e.g. ``textsql demo --run-dir DIR``.
    :rtype: typing.Callable
    """

    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None:
            return
        if ctx.get_parameter_source(str(param.name)) is ParameterSource.ENVIRONMENT:
            variable = f"{ctx.auto_envvar_prefix}_{str(param.name).upper()}"
            renamed = f"{ctx.auto_envvar_prefix}_{new[2:].replace('-', '_').upper()}"
            raise click.UsageError(f"{variable} was renamed {renamed}: set that instead", ctx)
        raise click.UsageError(f"{old} was renamed {new}: {usage}", ctx)

    return click.option(old, hidden=True, expose_value=False, callback=refuse, is_eager=True)


# TEXTSQL_<COMMAND>_<OPTION> variables of the previous release that were named after the function's argument
# instead of the option; refused with the new name by :class:`textsql.cli.help.Command`, for one release.
RENAMED_VARIABLES = {
    "TEXTSQL_DEMO_PARAMETERS": "TEXTSQL_DEMO_PARAMETER",
    "TEXTSQL_PREFLIGHT_PARAMETERS": "TEXTSQL_PREFLIGHT_PARAMETER",
    "TEXTSQL_ESTIMATE_NAMES": "TEXTSQL_ESTIMATE_PROFILE",
    "TEXTSQL_ESTIMATE_AS_JSON": "TEXTSQL_ESTIMATE_JSON",
    "TEXTSQL_EVALUATE_AS_JSON": "TEXTSQL_EVALUATE_JSON",
    "TEXTSQL_WORKERS_CLEANUP_RUN_ID": "TEXTSQL_WORKERS_CLEANUP_RUN",
}
