"""The arguments of each stage as dataclasses: one place for their names, defaults, help and checks.

``textsql prepare`` reads :class:`PrepareArguments`; every training rank reads :class:`ModelArguments`,
:class:`DataArguments` and :class:`RunArguments` beside HuggingFace's ``Seq2SeqTrainingArguments``
(parsed in :mod:`textsql.training.train`). The CLI's options take their help texts and defaults from these
fields (:func:`argument_field`), and notebooks, the bench and the tests build a training command line with
:func:`train_argv` instead of writing flags by hand. Nothing heavy is imported here, so ``textsql
--help`` stays fast.

These fields and :data:`TRAINING_DEFAULTS` are the one source of a run's defaults: notebook 02's
parameters cell, ``textsql demo`` and the AMP's environment variables repeat them (a notebook's
parameters must be literals), and ``tests/test_defaults.py`` fails when a copy drifts
(:func:`textsql.pipeline.parameters.notebook_defaults` names them as the notebook does). The learning rate,
its schedule and warm-up are the model's recipe's (:mod:`textsql.planning.recipe`).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textsql.constants import DEFAULT_MAX_SOURCE_LENGTH, INPUT_FORMATS, SAMPLE_SOURCE
from textsql.errors import DataError, LaunchError, ModelError

if TYPE_CHECKING:
    from transformers import TrainingArguments

logger = logging.getLogger(__name__)

# Tokens of a target query by default (WikiSQL's longest fit).
DEFAULT_MAX_TARGET_LENGTH = 128

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# What the training loss normalises over (textsql.training.loss).
LOSS_VOCABULARIES = ("auto", "full", "batch")
# Trainer flags this program sets itself, and the flag to use instead.
REPLACED_FLAGS = {
    "deepspeed": "--profile",
    "bf16": "--precision bf16",
    "fp16": "--precision fp16",
}
# The run directory is Seq2SeqTrainingArguments' output_dir, spelled as every textsql command spells it.
RUN_DIR_FLAG = "--run-dir"
# Training flags of the previous release and how they are written now (refused with it, for one release).
RENAMED_TRAIN_FLAGS = {
    "--output-dir": f"{RUN_DIR_FLAG} DIR",
    "--output_dir": f"{RUN_DIR_FLAG} DIR",
    "--resume": "--resume-from-checkpoint auto|PATH",
}
# How `textsql train` flags are spelled (its help says it; textsql.planning.train_args parses both).
TRAIN_SPELLING = (
    "Flags are written in kebab-case (--per-device-train-batch-size), as every textsql command's; HuggingFace's "
    "snake_case (--per_device_train_batch_size) is accepted too, so commands from transformers' docs work as they "
    "are. Booleans are --x/--no-x (or --x true|false)."
)
# Defaults that differ from Seq2SeqTrainingArguments' own, for this task (every one can be overridden).
TRAINING_DEFAULTS: dict[str, Any] = {
    "report_to": "tensorboard",
    "predict_with_generate": True,
    "generation_max_length": 64,
    # Per rank; on a GPU batches are filled to a token budget instead (textsql.planning.device_defaults.fast_defaults).
    "per_device_train_batch_size": 16,
    "eval_strategy": "steps",
    "eval_steps": 100,
    "save_steps": 100,
    "save_total_limit": 2,
    "logging_steps": 10,
    "train_sampling_strategy": "group_by_length",
    # The evaluation's sampler reorders questions; their input ids find each one's table (textsql.training.metrics).
    "include_for_metrics": ["inputs"],
    # Bounded wait for a dead peer in a collective (torch's default is 30 minutes): the survivors of a
    # lost worker fail within this, so the supervisor can relaunch. Generous for a first collective
    # that waits out CPU Adam's one-time compile.
    "ddp_timeout": 300,
}


@dataclass
class PrepareArguments:
    """What ``textsql prepare`` reads, how it tokenizes, and where it writes."""

    data_dir: str = field(metadata={"help": "Directory to write (save_to_disk DatasetDict, prepare.json, tables/)."})
    source: str = field(
        default=SAMPLE_SOURCE,
        metadata={
            "help": "sample (the shipped real sample), synthetic (template questions over its tables, with rows), "
            "synthetic-select (no conditions, four-column training tables: the learning check), "
            "sample+synthetic, hub (Salesforce/wikisql), or a directory in the WikiSQL release layout."
        },
    )
    model: str | None = field(
        default="default",
        metadata={
            "help": 'Tokenizer: "default" (the embedded small T5), a hub id such as t5-small, or a model directory.'
        },
    )
    input_format: str = field(
        default="schema",
        metadata={
            "help": "schema: the question and the table's column names; question: the question alone; "
            "uncased: schema in lower case, and the query written in lower case (for a model from random weights)."
        },
    )
    num_proc: int = field(default=1, metadata={"help": "Processes for tokenization (datasets map num_proc)."})
    max_source_length: int = field(
        default=DEFAULT_MAX_SOURCE_LENGTH,
        metadata={"help": "Input tokens kept per question (longer ones are truncated and counted)."},
    )
    max_target_length: int = field(
        default=DEFAULT_MAX_TARGET_LENGTH,
        metadata={"help": "Target tokens kept per query (longer ones are truncated and counted)."},
    )
    limit: int | None = field(
        default=None, metadata={"help": "Keep only the first N questions of each split (quick runs)."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace --data-dir if it exists."})

    def __post_init__(self) -> None:
        if not str(self.data_dir).strip():
            raise DataError("no data directory to write; pass --data-dir DIR")
        if self.input_format not in INPUT_FORMATS:
            raise DataError(
                f"unknown input format {self.input_format!r}; pass --input-format {' or '.join(INPUT_FORMATS)}"
            )
        if self.num_proc < 1:
            raise DataError(f"num_proc must be at least 1, got {self.num_proc!r}; pass --num-proc 1 or more")
        for name in ("max_source_length", "max_target_length"):
            if getattr(self, name) < 2:
                raise DataError(
                    f"{name} must be at least 2 (one token and </s>), got {getattr(self, name)!r}; pass {kebab_flag(name)} N"
                )
        if self.limit is not None and self.limit < 1:
            raise DataError(f"limit must be at least 1, got {self.limit!r}; pass --limit N or leave it out")


@dataclass
class ModelArguments:
    """Which model to fine-tune, and in which precision."""

    model: str = field(
        default="default",
        metadata={
            "help": "Model to fine-tune: a hub id (t5-small), a local directory, or 'default' for the embedded small T5."
        },
    )
    precision: str = field(
        default="auto",
        metadata={
            "help": "auto (bf16 where the GPU supports it, else fp32), bf16, fp16 or fp32.",
            "choices": PRECISIONS,
        },
    )
    force_fp16: bool = field(
        default=False,
        metadata={"help": "Allow --precision fp16 although T5 overflows in fp16 (inf/NaN losses)."},
    )
    loss_vocabulary: str = field(
        default="auto",
        metadata={
            "help": "What the training loss's softmax covers: full (T5's whole vocabulary), batch (the tokens of the "
            "batch's questions, headers and queries: about 4x faster steps for a T5 trained from scratch on a CPU), "
            "auto (batch for a model built from a config, full for one with weights).",
            "choices": LOSS_VOCABULARIES,
        },
    )

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ModelError(f"unknown precision {self.precision!r}; pass --precision one of {', '.join(PRECISIONS)}")
        if self.loss_vocabulary not in LOSS_VOCABULARIES:
            raise ModelError(
                f"unknown loss vocabulary {self.loss_vocabulary!r}; pass --loss-vocabulary one of {', '.join(LOSS_VOCABULARIES)}"
            )
        if self.precision == "fp16" and not self.force_fp16:
            raise ModelError(
                "T5 overflows in fp16 (inf/NaN loss); pass --precision bf16 or fp32, or add --force-fp16 to insist"
            )


@dataclass
class DataArguments:
    """The prepared dataset (``textsql prepare --data-dir DIR``) and how much of it to use."""

    data_dir: str | None = field(
        default=None, metadata={"help": "Prepared dataset directory written by `textsql prepare --data-dir DIR`."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N examples only."})
    max_eval_samples: int = field(
        default=64,
        metadata={
            "help": "Validation examples used for eval loss and generated exact match (generation is slow, keep it small)."
        },
    )
    pad_to_multiple_of: int | None = field(
        default=8, metadata={"help": "Pad each batch to a multiple of N tokens (tensor-core friendly)."}
    )
    constrained: bool = field(
        default=True,
        metadata={
            "help": "Evaluation generates only WikiSQL queries over each question's table (textsql.decoding.grammar); --no-constrained generates freely."
        },
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={
            "help": "Fill training batches from length buckets to N padded tokens instead of a count of examples (default on a GPU: sized from its memory)."
        },
    )
    length_group_size: int | None = field(
        default=None,
        metadata={
            "help": "With group_by_length sampling: examples per length group (default: per-rank batch x gradient "
            "accumulation, as transformers does); a run that goes on with fewer workers keeps its first launch's, so its data order continues."
        },
    )

    def __post_init__(self) -> None:
        self.prepared_dir()

    def prepared_dir(self) -> str:
        """``data_dir``, which is optional only as a flag: a run without it is refused (when parsed, too).

        :rtype: str
        """
        if not self.data_dir:
            raise DataError("no dataset given; pass --data-dir DIR written by `textsql prepare --data-dir DIR`")
        return self.data_dir


@dataclass
class RunArguments:
    """The DeepSpeed profile and what to do with an existing output directory."""

    profile: str = field(
        default="auto",
        metadata={
            "help": "DeepSpeed profile: auto (the cheapest that fits the model, as `textsql estimate` recommends), "
            "the name of a dsconfig/*.json file (`textsql estimate --help` lists them), or a .json path."
        },
    )
    overlay: list[str] = field(
        default_factory=list, metadata={"help": "Overlays merged onto the profile, e.g. flops_profiler."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Delete the checkpoints and model/ of a previous run in --run-dir before training."},
    )
    eval_share: float | None = field(
        default=None,
        metadata={
            "help": "Largest share of training time evaluation may take: an --eval-steps boundary evaluates only once "
            "training has run the last evaluation's duration x (1 - share) / share since it; 0 evaluates at every "
            "boundary (default: 0.05 on a GPU, where steps are large; 0 on CPUs)."
        },
    )
    save_every_minutes: float | None = field(
        default=None,
        metadata={
            "help": "Least training time between checkpoints: a --save-steps boundary saves only once this many "
            "minutes passed since the last checkpoint; 0 saves at every boundary (default: 10 on a GPU; 0 on CPUs)."
        },
    )
    # Set once --profile auto is resolved (textsql.training.train), for run.json and the stage line.
    auto_profile: bool = field(default=False, init=False)
    # Set with the DeepSpeed config (textsql.planning.profiles.autocast_bf16): the norm the optimizer clips
    # to itself, DeepSpeed then clipping nothing (0: DeepSpeed clips, as --max_grad_norm says).
    optimizer_max_grad_norm: float = field(default=0.0, init=False)
    # Set once the model is known (textsql.planning.train_args): the recipe it trains with, for run.json.
    recipe: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.eval_share is not None and not 0 <= self.eval_share < 1:
            raise LaunchError(f"eval_share must be in [0, 1), got {self.eval_share!r}; pass --eval-share 0.05 or 0")
        if self.save_every_minutes is not None and self.save_every_minutes < 0:
            raise LaunchError(
                f"save_every_minutes must be 0 or more, got {self.save_every_minutes!r}; pass --save-every-minutes 10 or 0"
            )


@dataclass
class GenerationOptions:
    """How many questions go through the model at once, and how it decodes (``textsql infer``, notebook 03)."""

    # 64 questions x 4 beams: on a 2-core CPU the demo's 1,000 held-out questions take 41 s instead of 44 at 32,
    # with the same answers (128 is slower: the beams' cache outgrows the CPU's); a GPU has room for either.
    batch_size: int = field(default=64, metadata={"help": "Questions per generate() call."})
    num_beams: int = field(
        default=4,
        metadata={
            "help": "Beam width (1: greedy). With tables that carry rows, execution guidance answers with the first beam whose query runs and finds something."
        },
    )
    max_new_tokens: int = field(
        default=DEFAULT_MAX_TARGET_LENGTH, metadata={"help": "Most tokens generated per query."}
    )
    max_source_length: int = field(
        default=DEFAULT_MAX_SOURCE_LENGTH, metadata={"help": "Input tokens kept per question (as prepare truncates)."}
    )
    constrained: bool = field(
        default=True,
        metadata={
            "help": "Write only WikiSQL queries over the question's own table (textsql.decoding.grammar); --no-constrained decodes freely."
        },
    )
    execution_guided: bool = field(
        default=True,
        metadata={
            "help": "With beams and tables that carry rows: answer with the first beam whose query runs and finds something."
        },
    )

    def __post_init__(self) -> None:
        for name in ("batch_size", "num_beams", "max_new_tokens", "max_source_length"):
            if getattr(self, name) < 1:
                raise DataError(
                    f"{name} must be at least 1, got {getattr(self, name)!r}; pass {kebab_flag(name)} 1 or more"
                )


def kebab_flag(name: str) -> str:
    """The command-line flag of an argument field, in the spelling textsql documents: ``--max-steps`` for ``max_steps``.

    :rtype: str
    """
    return f"--{name.replace('_', '-')}"


def argument_field(cls: type, name: str) -> Field:
    """The field ``name`` of the arguments dataclass ``cls``: the CLI takes an option's help and default from it.

    :raises KeyError: when ``cls`` has no such field.
    :rtype: dataclasses.Field
    """
    return next(spec for spec in fields(cls) if spec.name == name)


def train_argv(**values: Any) -> list[str]:
    """The command line of ``textsql train`` (and of each rank under ``textsql launch``) for these values.

    Names are fields of :class:`ModelArguments`, :class:`DataArguments`, :class:`RunArguments` or
    ``Seq2SeqTrainingArguments``, named as their flags are (``run_dir`` for its ``output_dir``); ``None``
    and empty lists leave a flag out, booleans are written ``true``/``false`` and lists give one value each.
    The list is what the ranks parse, so checking it with
    :func:`textsql.planning.train_args.check_train_args` checks the run.

    Usage::

        >>> train_argv(data_dir="data", run_dir="out", profile="zero3", max_steps=10, overwrite_output_dir=True)
        ['--data-dir', 'data', '--run-dir', 'out', '--profile', 'zero3', '--max-steps', '10', '--overwrite-output-dir', 'true']

    :raises LaunchError: for a name that is no training argument (with the closest one, or its new name).
    :rtype: list[str]
    """
    from transformers import Seq2SeqTrainingArguments

    renamed = {
        old[2:].replace("-", "_"): new.split()[0][2:].replace("-", "_") for old, new in RENAMED_TRAIN_FLAGS.items()
    }
    known = [
        renamed.get(spec.name, spec.name)
        for cls in (ModelArguments, DataArguments, RunArguments, Seq2SeqTrainingArguments)
        for spec in fields(cls)
    ]
    argv: list[str] = []
    for name, value in values.items():
        if name not in known:
            close = [renamed[name]] if name in renamed else difflib.get_close_matches(name, known, n=1)
            raise LaunchError(
                f"unknown training argument {name!r}{f' (did you mean {close[0]}?)' if close else ''}; see `textsql train --help`"
            )
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if value is not None and items:
            argv += [kebab_flag(name), *(str(item).lower() if isinstance(item, bool) else str(item) for item in items)]
    return argv


def output_path(args: TrainingArguments) -> Path:
    """The run's output directory: ``TrainingArguments`` declares it optional but fills in a default when built.

    :rtype: pathlib.Path
    """
    if args.output_dir is None:
        raise TypeError("TrainingArguments.output_dir is None: build the arguments through their __post_init__")
    return Path(args.output_dir)
