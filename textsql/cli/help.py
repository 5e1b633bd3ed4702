"""How the ``textsql`` command presents itself: commands in the order a run uses them, each option's
``TEXTSQL_...`` environment variable, options in titled sections, and the short page of ``textsql train -h``.

click lists a group's commands alphabetically and its options in one block; these classes change only how
help is written, never how a command line is parsed. Nothing heavy is imported here, so ``--help`` stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import click

from textsql.arguments import (
    TRAIN_SPELLING,
    TRAINING_DEFAULTS,
    DataArguments,
    ModelArguments,
    RunArguments,
    argument_field,
    kebab_flag,
)
from textsql.cli.options import RENAMED_VARIABLES
from textsql.planning.recipe import FROM_CONFIG_RECIPE, RATE_CHOSEN_AT_TOKENS, WITH_WEIGHTS_RECIPE

# `textsql train -h`: the flags most runs set. Ours take their help from the argument dataclasses; the few of
# Seq2SeqTrainingArguments are described here, because reading theirs would import transformers and torch.
TRAIN_ESSENTIALS: tuple[tuple[str, Any], ...] = (
    ("data_dir", DataArguments),
    ("run_dir", "Where checkpoints, model/, run.json and tensorboard/ go (required)."),
    ("model", ModelArguments),
    ("profile", RunArguments),
    ("precision", ModelArguments),
    ("max_steps", "Optimizer steps to train [default: -1, the epochs decide]."),
    ("num_train_epochs", "Epochs to train when --max-steps is not given [default: 3.0]."),
    (
        "per_device_train_batch_size",
        (
            f"Examples per rank and step [default: {TRAINING_DEFAULTS['per_device_train_batch_size']}; "
            "on a GPU batches are filled to a token budget instead, see --max-tokens-per-batch]."
        ),
    ),
    ("gradient_accumulation_steps", "Batches summed into one optimizer step [default: 1]."),
    (
        "learning_rate",
        (
            f"Peak learning rate [default: the model's recipe: {FROM_CONFIG_RECIPE.learning_rate:g} "
            f"{FROM_CONFIG_RECIPE.schedule} for a model built from its config (in token-budget batches warmed up "
            f"and scaled by the square root of the tokens a step over {RATE_CHOSEN_AT_TOKENS:,}), "
            f"{WITH_WEIGHTS_RECIPE.learning_rate:g} "
            f"with warm-up and {WITH_WEIGHTS_RECIPE.schedule} decay for one with weights]."
        ),
    ),
    ("eval_steps", f"Evaluate every N steps [default: {TRAINING_DEFAULTS['eval_steps']}]."),
    ("save_steps", f"Checkpoint every N steps [default: {TRAINING_DEFAULTS['save_steps']}]."),
    (
        "resume_from_checkpoint",
        "auto: resume from the newest complete checkpoint in --run-dir (a fresh start if none); or a checkpoint path.",
    ),
    ("overwrite_output_dir", RunArguments),
    ("max_train_samples", DataArguments),
    ("max_tokens_per_batch", DataArguments),
)


def _show_envvars(params: Sequence[click.Parameter]) -> None:
    """Show each option's environment variable in --help (the group reads them: ``auto_envvar_prefix``);
    eager options (--help, --version) act before any variable is read."""
    for param in params:
        if isinstance(param, click.Option) and not param.is_eager and param.allow_from_autoenv:
            param.show_envvar = True


class Command(click.Command):
    """A command whose --help names the ``TEXTSQL_<COMMAND>_<OPTION>`` variable of every option, and which
    refuses a variable of the previous release (:data:`textsql.cli.options.RENAMED_VARIABLES`) with its new name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _show_envvars(self.params)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for old, new in RENAMED_VARIABLES.items():
            if old in os.environ and new.startswith(f"{ctx.auto_envvar_prefix}_"):
                raise click.UsageError(f"{old} was renamed {new}: set that instead", ctx)
        return super().parse_args(ctx, args)


class SectionedCommand(Command):
    """A command whose --help lists options under titles: ``sections`` maps a title to parameter names
    (the names click passes to the function); options in no section come last under "Options"."""

    def __init__(self, *args: Any, sections: dict[str, Sequence[str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        options = {param.name: param for param in self.get_params(ctx) if isinstance(param, click.Option)}
        placed = {name for names in self.sections.values() for name in names}
        rest = [name for name in options if name not in placed]
        for title, names in [*self.sections.items(), ("Options", rest)]:
            records = [record for name in names if (record := options[name].get_help_record(ctx)) is not None]
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class TrainCommand(Command):
    """``textsql train``: -h prints :data:`TRAIN_ESSENTIALS` (no transformers or torch import); every flag is
    in ``--help-all``, the training parser's own help."""

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[FLAGS]...")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_paragraph()
        formatter.write_text(TRAIN_SPELLING)
        with formatter.section("Flags most runs set"):
            formatter.write_dl([_train_flag(name, source) for name, source in TRAIN_ESSENTIALS])
        super().format_options(ctx, formatter)


def _train_flag(name: str, source: Any) -> tuple[str, str]:
    if isinstance(source, str):
        return kebab_flag(name), source
    spec = argument_field(source, name)
    default = "" if spec.default in (None, False) else f" [default: {spec.default}]"
    return kebab_flag(name), spec.metadata["help"] + default


class PipelineGroup(click.Group):
    """A group that lists its commands in ``order`` (then any others, by name) and shows its options'
    environment variables; its commands and subgroups are built the same way."""

    command_class = Command
    group_class = type

    def __init__(self, *args: Any, order: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.order = tuple(order)
        _show_envvars(self.params)

    def list_commands(self, ctx: click.Context) -> list[str]:
        rank = {name: index for index, name in enumerate(self.order)}
        return sorted(self.commands, key=lambda name: (rank.get(name, len(rank)), name))
