"""The training command line, parsed as every rank parses it: strict flags, the profile as the ``deepspeed``
config, the precision resolved; and :func:`check_train_args`, the same parse on the launching machine.

Only the argument classes are imported here (transformers' ``Seq2SeqTrainingArguments`` and torch under it),
not the trainer, datasets or the models: ``textsql launch`` and notebook 02 check a command line before any
rank starts, and that check lies on the way to the first training step.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import Field, fields
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from transformers import HfArgumentParser, Seq2SeqTrainingArguments
from transformers.hf_argparser import DataClassType

from textsql.arguments import (
    RENAMED_TRAIN_FLAGS,
    REPLACED_FLAGS,
    RUN_DIR_FLAG,
    TRAIN_SPELLING,
    TRAINING_DEFAULTS,
    DataArguments,
    ModelArguments,
    RunArguments,
    kebab_flag,
)
from textsql.data.tables import check_prepared
from textsql.errors import LaunchError, RenamedOptionError
from textsql.model import builds_from_config, load_config
from textsql.planning.device_defaults import device_facts, fast_defaults
from textsql.planning.estimate import AUTO_PROFILE, resolve_profile_here
from textsql.planning.profiles import autocast_bf16, available_profiles, get_profile, load_profile, run_profile
from textsql.planning.recipe import Recipe, training_recipe
from textsql.planning.world import world_size
from textsql.tracking.mlflow_runs import check_tracking

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class _Renamed(argparse.Action):
    """A flag of the previous release: refused with the one that replaced it."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None
    ) -> NoReturn:
        usage = RENAMED_TRAIN_FLAGS[str(option_string)]
        raise RenamedOptionError(f"{option_string} was renamed {usage.split()[0]}: textsql train {usage}")


class _StrictParser(HfArgumentParser):
    """HfArgumentParser whose errors are one line (a LaunchError) instead of the full usage text, whose
    every boolean has a ``--no-x`` (HfArgumentParser gives one only to booleans that default to true), whose
    ``output_dir`` is ``--run-dir`` as in every textsql command, and whose help lists each flag's kebab-case
    spelling first."""

    def __init__(self, dataclass_types: list[DataClassType], **kwargs: Any) -> None:
        super().__init__(dataclass_types, **kwargs)
        output_dir = self._option_string_actions["--output_dir"]
        for option in output_dir.option_strings:
            del self._option_string_actions[option]
        output_dir.option_strings = [RUN_DIR_FLAG, "--run_dir"]
        self._option_string_actions |= dict.fromkeys(output_dir.option_strings, output_dir)
        output_dir.metavar = "RUN_DIR"
        output_dir.help = "The run directory: checkpoints, model/, run.json and tensorboard/ go there."
        self.add_argument(*RENAMED_TRAIN_FLAGS, action=_Renamed, nargs="?", help=argparse.SUPPRESS)
        # Kebab-case is the spelling textsql documents (TRAIN_SPELLING): it comes first in the help and errors.
        for action in self._actions:
            action.option_strings = sorted(action.option_strings, key=lambda option: "_" in option)

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: Field) -> None:
        HfArgumentParser._parse_dataclass_field(parser, field)
        if field.default is not True and field.type in (bool, bool | None):
            parser.add_argument(
                f"--no_{field.name}",
                "--no-" + kebab_flag(field.name)[2:],
                action="store_false",
                dest=field.name,
                help=argparse.SUPPRESS,
            )

    def error(self, message: str) -> NoReturn:
        raise LaunchError(f"{message.rstrip('.')}; see `textsql train --help`")


def parse_command_line(
    argv: list[str] | None = None, on_rank: bool = True
) -> tuple[ModelArguments, DataArguments, RunArguments, dict[str, Any]]:
    """Parse strictly: typos and unknown flags fail (no abbreviations), booleans take ``true``/``false``.

    The profile becomes the ``deepspeed`` config and ``--precision`` sets ``bf16``/``fp16``, so those
    trainer flags are refused to keep one way of saying each thing. Nothing distributed starts here.

    :param on_rank: a rank resolves ``--profile auto`` from its own world and device. The launching machine
        (``False``) may share neither, so it leaves ``auto`` to the ranks (``deepspeed`` is then ``None``) and checks
        every profile auto may pick instead; it builds no model and imports no DeepSpeed for the estimate.
    :returns: the three argument dataclasses and the keyword arguments of ``Seq2SeqTrainingArguments``.
    :rtype: tuple[ModelArguments, DataArguments, RunArguments, dict]
    """
    values, recipe = _parsed_values(sys.argv[1:] if argv is None else argv)
    model_args = ModelArguments(**_field_values(ModelArguments, values))
    data_args = DataArguments(**_field_values(DataArguments, values))
    run_args = RunArguments(**_field_values(RunArguments, values))
    for flag, replacement in REPLACED_FLAGS.items():
        if values[flag]:
            raise LaunchError(f"{kebab_flag(flag)} is set by this program; pass {replacement} instead")
    if values["output_dir"] is None:
        raise LaunchError(f"no run directory; pass {RUN_DIR_FLAG} DIR")
    if values["resume_from_checkpoint"] and run_args.overwrite_output_dir:
        raise LaunchError("--resume-from-checkpoint and --overwrite-output-dir contradict each other; pass only one")
    if isinstance(values["report_to"], str) and "," in values["report_to"]:
        # --report-to takes one word on a command line: tensorboard,mlflow names both (the trainer takes a list).
        values["report_to"] = [name.strip() for name in values["report_to"].split(",")]
    check_tracking(values["report_to"])
    run_args.recipe = recipe_record(recipe, values)
    model_args.precision = resolve_precision(model_args.precision)
    # auto: the estimate's recommendation for this rank's world and device (textsql.planning.estimate).
    run_profile(run_args.profile)
    run_args.auto_profile = run_args.profile == AUTO_PROFILE
    if on_rank:
        run_args.profile = resolve_profile_here(run_args.profile, model_args.model)
    config: dict[str, Any] | None = None
    autocast = False
    # Left to the ranks, auto may pick any profile: each is checked against the precision and the overlays.
    for name in available_profiles() if run_args.profile == AUTO_PROFILE else [run_args.profile]:
        get_profile(name).check_precision(model_args.precision)
        loaded = load_profile(name, run_args.overlay)
        if run_args.profile != AUTO_PROFILE:
            config, autocast = autocast_bf16(loaded) if model_args.precision == "bf16" else (loaded, False)
    training_values = _field_values(Seq2SeqTrainingArguments, values)
    if autocast:
        # DeepSpeed's "auto" clipping becomes 0 and the optimizer clips (textsql.training.clipping: no loop per tensor).
        run_args.optimizer_max_grad_norm, training_values["max_grad_norm"] = training_values["max_grad_norm"], 0.0
    training_values |= {
        "deepspeed": config,
        # Under torch autocast the weights stay fp32: the trainer's bf16 flag would ask DeepSpeed for bf16 weights.
        "bf16": model_args.precision == "bf16" and not autocast,
        "fp16": model_args.precision == "fp16",
        # Pinned batches (on CUDA) are copied to the device without waiting: the step's first kernels queue
        # behind the copy on the GPU instead of the host blocking on it.
        "accelerator_config": {"use_configured_state": True, "non_blocking": training_values["dataloader_pin_memory"]},
    }
    return model_args, data_args, run_args, training_values


def _parsed_values(argv: list[str]) -> tuple[dict[str, Any], Recipe]:
    """Every flag's value, parsed strictly, over the defaults of this machine and then of the model's recipe.

    :raises LaunchError: for an unknown flag, naming the closest known one.
    :returns: the values by field name, and the model's training recipe.
    :rtype: tuple[dict, Recipe]
    """
    parser = _StrictParser(
        [DataClassType(cls) for cls in (ModelArguments, DataArguments, RunArguments, Seq2SeqTrainingArguments)],
        prog="textsql train",
        description=TRAIN_SPELLING,
        allow_abbrev=False,
    )
    parser.set_defaults(**TRAINING_DEFAULTS, **fast_defaults(device_facts()))
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise LaunchError(
            f"unknown argument {unknown[0]!r}{_suggestion(parser, unknown[0])}; see `textsql train --help`"
        )
    # The recipe depends on the model, known only once parsed; parsed again with its values as defaults, a flag
    # given on the command line keeps its value (argparse applies defaults only to flags left out).
    recipe = training_recipe(builds_from_config(namespace.model), _tokens_a_step(namespace))
    parser.set_defaults(**recipe.training_values())
    return vars(parser.parse_known_args(argv)[0]), recipe


def _tokens_a_step(namespace: argparse.Namespace) -> int | None:
    """The tokens of one optimizer step over all ranks, batched to a token budget; ``None`` without one.

    A rank reads its world from the launcher (:func:`textsql.planning.world.world_size`); the launching machine,
    which has none, counts one rank (its recipe only checks the command line: each rank records its own).
    """
    if not namespace.max_tokens_per_batch:
        return None
    return int(namespace.max_tokens_per_batch) * int(namespace.gradient_accumulation_steps) * world_size()


def check_train_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, RunArguments, dict[str, Any]]:
    """Parse a training command line on the launching machine, before any worker or rank starts, and check it.

    It is parsed exactly as every rank will parse it (flags, profile, precision, output directory), and
    the model's config and the prepared dataset it names are read; nothing distributed starts. A launch parses
    through here once (:meth:`textsql.launching.training_plan.TrainingPlan.read`).

    Usage::

        >>> check_train_args(train_argv(data_dir="runs/data", run_dir="runs/r1", profile="zero9"))
        Traceback (most recent call last):
        textsql.errors.ProfileError: unknown profile 'zero9'; pass --profile one of auto, zero0, ...

    :param argv: the arguments of ``textsql train`` (see :func:`textsql.arguments.train_argv`).
    :returns: what :func:`parse_command_line` returns.
    :rtype: tuple[ModelArguments, DataArguments, RunArguments, dict]
    :raises TextSQLError: a ProfileError, ModelError, DataError or LaunchError naming the fix.
    """
    parsed = parse_command_line(argv, on_rank=False)
    load_config(parsed[0].model)
    check_prepared(parsed[1].prepared_dir())
    return parsed


def recipe_record(recipe: Recipe, values: dict[str, Any]) -> dict[str, Any]:
    """What run.json keeps of the recipe: the values the run trains with, and which of them flags changed.

    :param recipe: the model's (:func:`textsql.planning.recipe.training_recipe`).
    :param values: the parsed command line.
    :rtype: dict[str, typing.Any]
    """
    chosen = recipe.training_values()
    return {
        "name": recipe.name,
        "optimizer": str(values["optim"]),
        "peak_learning_rate": values["learning_rate"],
        "schedule": values["lr_scheduler_type"],
        "warmup_steps": values["warmup_steps"],
        "why": recipe.why,
        "overridden": sorted(name for name, value in chosen.items() if values[name] != value),
    }


def resolve_precision(precision: str) -> str:
    """Turn ``auto`` into ``bf16`` where the GPU supports it, else ``fp32``; other values pass through.

    :rtype: str
    """
    if precision != "auto":
        return precision
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


def _field_values(cls: type[DataclassInstance], values: dict[str, Any]) -> dict[str, Any]:
    """The parsed values that belong to one argument dataclass (as HfArgumentParser splits them)."""
    return {f.name: values[f.name] for f in fields(cls) if f.init}


def _suggestion(parser: HfArgumentParser, argument: str) -> str:
    flags = [option for action in parser._actions for option in action.option_strings]
    close = difflib.get_close_matches(argument.split("=", 1)[0], flags, n=1)
    return f" (did you mean {close[0]}?)" if close else ""
