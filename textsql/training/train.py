"""Fine-tune T5 for text-to-SQL with DeepSpeed: the program every rank runs.

``deepspeed ... --module textsql.training.train --profile zero3 --data-dir DATA --run-dir RUN`` (through
``textsql launch``) or, for one process, ``textsql train ...``. The order follows HuggingFace's
``run_translation.py``: parse → logging → output directory and checkpoint → seed → data → tokenizer
and model → collator → metric → ``Seq2SeqTrainer`` → train → evaluate → export.

The same code runs on GPUs and on a CPU-only machine: there DeepSpeed picks its CPU accelerator, and
the distributed state is built with gloo *before* the training arguments (see
:func:`init_distributed`), otherwise transformers computes a world size of 1 and fails DeepSpeed's
batch-size check, or silently trains with plain DDP instead of a DeepSpeed engine.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

import datasets
import torch
import transformers
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments, set_seed

from textsql.arguments import DataArguments, ModelArguments, RunArguments, output_path
from textsql.constants import LABEL_PAD_TOKEN_ID, MODEL_SUBDIR, PREPARE_JSON_NAME, RUN_SUMMARY_NAME, UNCASED_FORMAT
from textsql.data.wikisql import recorded_input_format
from textsql.decoding.bounds import KeepGenerationBound, bound_generation
from textsql.errors import DataError, TextSQLError
from textsql.json_files import write_json, write_jsonl
from textsql.model import load_tokenizer
from textsql.model.speedups import speed_up_training
from textsql.model_card import write_training_card
from textsql.planning.estimate import AUTO_PROFILE
from textsql.planning.train_args import parse_command_line
from textsql.planning.world import ranks_on_this_node, world_size
from textsql.rundir.universal import load_universal
from textsql.tracking.mlflow_free import import_deepspeed_lean
from textsql.tracking.mlflow_runs import finish_tracking, run_params, start_tracking
from textsql.training.batching import TokenBudgetTrainer
from textsql.training.collective import exit_on_failure
from textsql.training.compiling import prepare_compilation
from textsql.training.events import close_run_events, events_dir, use_run_events
from textsql.training.hardware import (
    share_cpu_threads,
    teardown_distributed,
    token_budget_record,
)
from textsql.training.loss import TrainingLossT5, resolve_loss_vocabulary, training_model
from textsql.training.mark_complete import MarkComplete
from textsql.training.metrics import decode, eval_questions, wikisql_metrics
from textsql.training.output_dir import export_model, prepare_output_dir, resume_checkpoint
from textsql.training.progress import (
    announce_op_build,
    announce_run,
    build_ops_with_pinned_ninja,
    pace_record,
    use_step_lines,
)
from textsql.training.schedule import TimedSchedule
from textsql.training.shared_buffer import release_allreduce_buffer
from textsql.training.trainer import GrammarSeq2SeqTrainer, KeptSchedule, ResumableTrainer
from worker.network import free_port

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MODEL_COLUMNS = ("input_ids", "attention_mask", "labels")
PREDICTIONS_FILE = "eval_predictions.jsonl"


def main(argv: list[str] | None = None) -> int:
    """Train, evaluate and export; the entry point of ``python -m textsql.training.train`` on every rank.

    :param argv: command-line arguments (``sys.argv[1:]`` when ``None``).
    :rtype: int
    """
    import_deepspeed_lean()
    model_args, data_args, run_args, training_args = parse_arguments(argv)
    _configure_logging(training_args)
    _announce_rank(model_args, run_args, training_args)
    # Before anything slow: ranks that cannot all-reduce end here, naming the host, in seconds.
    collective = exit_on_failure(output_path(training_args))
    checkpoint = prepare_output_dir(training_args, run_args)
    set_seed(training_args.seed)

    splits = load_prepared(data_args)
    tokenizer = load_tokenizer(model_args.model)
    model = model_to_train(model_args, training_args, splits.get("validation"))
    prepare_compilation(training_args.torch_compile)
    trainer = build_trainer(model, tokenizer, splits, data_args, run_args, training_args)
    start_tracking(trainer, run_params(model_args, data_args, run_args, training_args), resumed=checkpoint is not None)

    throughput = run_training(trainer, checkpoint)
    if "validation" in splits:
        evaluate(trainer, tokenizer, splits["validation"])
    close_run_events(trainer)
    export_model(trainer, output_path(training_args) / MODEL_SUBDIR, Path(data_args.prepared_dir()) / PREPARE_JSON_NAME)
    if trainer.is_world_process_zero():
        summary = _write_summary(trainer, model_args, run_args, checkpoint, collective, throughput)
        write_training_card(output_path(training_args) / MODEL_SUBDIR, summary)
    finish_tracking(trainer)
    teardown_distributed()
    return 0


def model_to_train(
    model_args: ModelArguments, training_args: Seq2SeqTrainingArguments, validation: datasets.Dataset | None
) -> TrainingLossT5:
    """The model, with the loss ``--loss_vocabulary`` asks for and the generation bounds evaluation sets.

    :param validation: the evaluation split, whose targets bound the generated length.
    :rtype: TrainingLossT5
    """
    model = training_model(model_args.model, resolve_loss_vocabulary(model_args.loss_vocabulary, model_args.model))
    changed = speed_up_training(model)
    logger.info("T5 made cheaper to step: %s", ", ".join(f"{count} {part}" for part, count in changed.items()))
    # T5's forward takes **kwargs but averages its loss itself, ignoring num_items_in_batch; left to
    # guess, the trainer multiplies that mean by the world size (loss and gradients x N on N ranks).
    model.accepts_loss_kwargs = False  # type: ignore[assignment]  # read by the trainer, undeclared on the model
    # Saved with model/, so inference generates as the evaluation here did.
    bound_generation(model, training_args, validation)
    if training_args.generation_num_beams:
        model.generation_config.num_beams = training_args.generation_num_beams
    return model


def build_trainer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    splits: datasets.DatasetDict,
    data_args: DataArguments,
    run_args: RunArguments,
    training_args: Seq2SeqTrainingArguments,
) -> TokenBudgetTrainer:
    """The run's trainer: token-budget batches padded per batch, the WikiSQL metrics with generation, the run's
    callbacks, and its step lines and TensorBoard events.

    :rtype: TokenBudgetTrainer
    """
    collator = DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=LABEL_PAD_TOKEN_ID, pad_to_multiple_of=data_args.pad_to_multiple_of
    )
    # Evaluation writes only WikiSQL queries over each question's table unless --no-constrained.
    trainer_class = (
        partial(GrammarSeq2SeqTrainer, uncased=recorded_input_format(data_args.prepared_dir()) == UNCASED_FORMAT)
        if data_args.constrained
        else ResumableTrainer
    )
    trainer = trainer_class(
        max_tokens_per_batch=data_args.max_tokens_per_batch,
        optimizer_max_grad_norm=run_args.optimizer_max_grad_norm,
        length_group_size=data_args.length_group_size,
        model=model,
        args=training_args,
        train_dataset=splits["train"],
        eval_dataset=splits.get("validation"),
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=wikisql_metrics(
            tokenizer, *eval_questions(data_args.prepared_dir(), data_args.max_eval_samples)
        )
        if training_args.predict_with_generate
        else None,
        callbacks=[
            KeepGenerationBound(),
            KeptSchedule(run_args.recipe),
            MarkComplete(),
            TimedSchedule(run_args.eval_share, run_args.save_every_minutes),
        ],
    )
    use_step_lines(trainer)
    use_run_events(trainer)
    return trainer


def run_training(trainer: TokenBudgetTrainer, checkpoint: str | None) -> dict:
    """Train (from ``checkpoint`` when resuming), then log and save the training metrics and the trainer's state.

    :returns: questions and tokens per second of the batches that ran, summed over the ranks (every rank calls it).
    :rtype: dict
    """
    result = trainer.train(resume_from_checkpoint=checkpoint)
    throughput = trainer.batch_counts.record(result.metrics["train_runtime"], trainer.args.device)
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    return throughput


def evaluate(
    trainer: TokenBudgetTrainer, tokenizer: PreTrainedTokenizerBase, dataset: datasets.Dataset
) -> dict[str, float]:
    """Final evaluation: loss and, with generation, exact match, logged to TensorBoard, and the
    generated queries written beside the targets to ``eval_predictions.jsonl`` (world process zero).

    :rtype: dict[str, float]
    """
    # The eval sampler follows the train sampling strategy; group_by_length would shuffle the
    # predictions away from the sources they are written beside.
    strategy, trainer.args.train_sampling_strategy = trainer.args.train_sampling_strategy, "sequential"
    try:
        output = trainer.predict(dataset, metric_key_prefix="eval")
    finally:
        trainer.args.train_sampling_strategy = strategy
    # Declared optional: predict always returns metrics, and the prepared validation split has labels.
    assert output.metrics is not None and output.label_ids is not None
    # The last in-training evaluation may have scored this same step already: log it once.
    if not any(
        "eval_loss" in entry and entry.get("step") == trainer.state.global_step for entry in trainer.state.log_history
    ):
        trainer.log(output.metrics)
    trainer.log_metrics("eval", output.metrics)
    trainer.save_metrics("eval", output.metrics)
    if trainer.is_world_process_zero() and trainer.args.predict_with_generate:
        sources = tokenizer.batch_decode(list(dataset["input_ids"]), skip_special_tokens=True)
        rows = zip(sources, decode(tokenizer, output.predictions), decode(tokenizer, output.label_ids))
        lines = [{"source": source, "prediction": prediction, "target": target} for source, prediction, target in rows]
        write_jsonl(output_path(trainer.args) / PREDICTIONS_FILE, lines)
    return output.metrics


def parse_arguments(
    argv: list[str] | None = None,
) -> tuple[ModelArguments, DataArguments, RunArguments, Seq2SeqTrainingArguments]:
    """Parse the command line, then build the training arguments on a DeepSpeed distributed state.

    :rtype: tuple[ModelArguments, DataArguments, RunArguments, Seq2SeqTrainingArguments]
    """
    model_args, data_args, run_args, training_values = parse_command_line(argv)
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(events_dir(training_values["output_dir"])))
    # The engine reads load_universal from its config, so the checkpoint is looked at before the config is used.
    checkpoint = resume_checkpoint(Path(training_values["output_dir"]), training_values["resume_from_checkpoint"])
    if checkpoint is not None and load_universal(Path(checkpoint), world_size()):
        config = training_values["deepspeed"]
        training_values["deepspeed"] = config | {"checkpoint": {**config.get("checkpoint", {}), "load_universal": True}}
        logger.warning("%s was written by another number of ranks: loading its universal conversion", checkpoint)
    init_distributed(timedelta(seconds=training_values["ddp_timeout"]))
    return model_args, data_args, run_args, Seq2SeqTrainingArguments(**training_values)


def init_distributed(timeout: timedelta) -> None:
    """Create accelerate's shared distributed state for DeepSpeed before the training arguments exist.

    Under the DeepSpeed launcher the rank variables are already set; a lone process (``textsql
    train``) gets a world of one on a free local port. Without a GPU the backend is gloo.
    """
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = None if torch.cuda.is_available() else "gloo"
    # DeepSpeed's per-node launcher tells each rank how many ranks share its node.
    share_cpu_threads(ranks_on_this_node())
    build_ops_with_pinned_ninja()
    announce_op_build()
    PartialState(backend=backend, timeout=timeout)
    release_allreduce_buffer()


def load_prepared(data_args: DataArguments) -> datasets.DatasetDict:
    """Load the prepared dataset and keep only the model's columns (padding happens per batch).

    :rtype: datasets.DatasetDict
    """
    try:
        loaded = datasets.load_from_disk(data_args.data_dir)
    except (FileNotFoundError, ValueError) as error:
        raise DataError(
            f"cannot load a prepared dataset from {data_args.data_dir!r} ({error}); run `textsql prepare --data-dir DIR` first"
        ) from None
    if not isinstance(loaded, datasets.DatasetDict) or "train" not in loaded:
        raise DataError(f"{data_args.data_dir!r} has no train split; run `textsql prepare --data-dir DIR` first")
    missing = [column for column in MODEL_COLUMNS if column not in loaded["train"].column_names]
    if missing:
        raise DataError(f"{data_args.data_dir!r} lacks columns {missing}; run `textsql prepare --data-dir DIR` again")
    splits = datasets.DatasetDict()
    splits["train"] = _first(loaded["train"], data_args.max_train_samples).select_columns(list(MODEL_COLUMNS))
    if "validation" in loaded and len(loaded["validation"]):
        splits["validation"] = _first(loaded["validation"], data_args.max_eval_samples).select_columns(
            list(MODEL_COLUMNS)
        )
    return splits


def _write_summary(
    trainer: TokenBudgetTrainer,
    model_args: ModelArguments,
    run_args: RunArguments,
    checkpoint: str | None,
    collective: dict,
    throughput: dict,
) -> dict:
    engine = trainer.model_wrapped
    trained = cast(TrainingLossT5, trainer.model)  # what model_to_train built
    summary = {
        "engine": f"{type(engine).__module__}.{type(engine).__qualname__}",
        "zero_stage": getattr(engine, "zero_optimization_stage", lambda: None)(),
        "world_size": trainer.args.world_size,
        "profile": run_args.profile,
        "profile_chosen_by": AUTO_PROFILE if run_args.auto_profile else "name",
        "precision": model_args.precision,
        "model": model_args.model,
        # How its optimizer stepped (textsql.planning.recipe.training_recipe), with the flags that changed it.
        "recipe": run_args.recipe,
        "loss_vocabulary": trained.loss_vocabulary,
        # Whether its steps computed T5's logits over the whole vocabulary (textsql.training.loss).
        "full_logits": trained.full_logits,
        "resumed_from": checkpoint,
        "global_step": trainer.state.global_step,
        "evaluation_share": evaluation_share(trainer.state.log_history),
        "eval_share_limit": run_args.eval_share,
        "save_every_minutes": run_args.save_every_minutes,
        # Questions and tokens per second of the batches that ran (the trainer's train_samples_per_second counts
        # per_device_train_batch_size questions a batch, whatever a token-budget batch held).
        "throughput": throughput,
        "token_budget": token_budget_record(getattr(trainer, "max_tokens_per_batch", None)),
        "log_history": trainer.state.log_history,
        # The steady pace and the time left said at each evaluation (textsql.training.time_left).
        "progress": pace_record(trainer),
        # The collective check of this launch (empty for a single rank): result and bandwidth per host.
        "collective": collective,
    }
    write_json(output_path(trainer.args) / RUN_SUMMARY_NAME, summary)
    return summary


def evaluation_share(log_history: list[dict]) -> float | None:
    """Share of the training loop's wall time its evaluations took (the final one, after training, not counted).

    :param log_history: the trainer's; the entry with ``train_runtime`` closes the training loop.
    :returns: a fraction, ``None`` before training ended.
    :rtype: float | None
    """
    for index, entry in enumerate(log_history):
        if entry.get("train_runtime"):
            evaluating = sum(earlier.get("eval_runtime", 0.0) for earlier in log_history[:index])
            return round(evaluating / entry["train_runtime"], 4)
    return None


def _announce_rank(model_args: ModelArguments, run_args: RunArguments, training_args: Seq2SeqTrainingArguments) -> None:
    """One line per rank (where it runs, its profile and precision), and the run's stage line from rank 0."""
    logger.warning(
        "rank %d/%d (local %d) on %s: profile %s, precision %s",
        training_args.process_index,
        training_args.world_size,
        training_args.local_process_index,
        training_args.device,
        run_args.profile,
        model_args.precision,
    )
    if training_args.process_index == 0:
        announce_run(
            str(model_args.model),
            run_args.profile,
            run_args.auto_profile,
            training_args.world_size,
            model_args.precision,
        )


def _configure_logging(args: Seq2SeqTrainingArguments) -> None:
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    level = args.get_process_log_level()
    logging.getLogger("textsql").setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def _first(dataset: datasets.Dataset, count: int | None) -> datasets.Dataset:
    return dataset if count is None or count >= len(dataset) else dataset.select(range(count))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TextSQLError as error:
        print(f"Error: {error}", file=sys.stderr)
        sys.exit(1)
