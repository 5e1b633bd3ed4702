"""The run's trainer: no step past ``max_steps`` when resumed at the end, the resumed schedule's rate recorded, and
the evaluation that runs during training, eagerly, with generation constrained to the WikiSQL grammar.

:class:`ResumableTrainer` is the token-budget trainer that resumes from a checkpoint already at ``max_steps`` (the
last one a killed run's ranks wrote) without training a step past it: the checkpoint loaded goes straight on to the
final evaluation and the model. Its ``warmup_stable_decay`` schedule (the from-scratch recipe's) learns the run's
step count here, where transformers knows it (:func:`textsql.planning.recipe.stable_decay_kwargs`).
:class:`KeptSchedule` records the rate a resumed run keeps from its checkpoint, where the command line asked another.

``Seq2SeqTrainer`` generates for each evaluation batch with the same keyword arguments; the grammar,
though, is each question's own, and a batch knows its questions only as token ids. So
:class:`GrammarGeneration` builds a :class:`textsql.decoding.processor.GrammarLogitsProcessor` per batch from
its input ids (the question and header read back from the input text) and hands it to ``generate``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import SchedulerType

from textsql.decoding.processor import processor_for_inputs
from textsql.planning.recipe import stable_decay_kwargs
from textsql.training.batching import TokenBudgetTrainer

logger = logging.getLogger(__name__)


def generation_budget(gen_kwargs: dict[str, Any], config: GenerationConfig) -> int:
    """The tokens an encoder-decoder ``generate`` call may write after the decoder's start token.

    As ``generate`` decides: ``max_new_tokens`` (call, then config) wins over ``max_length`` (call,
    then config), which counts the start token.

    :rtype: int
    """
    new_tokens = gen_kwargs.get("max_new_tokens") or config.max_new_tokens
    if new_tokens:
        return int(new_tokens)
    return int(gen_kwargs.get("max_length") or config.max_length) - 1


class ResumableTrainer(TokenBudgetTrainer):
    """:class:`~textsql.training.batching.TokenBudgetTrainer` that trains no step past ``max_steps`` when resumed
    there, whose ``warmup_stable_decay`` schedule decays over the recipe's share of the steps unless told, and which
    evaluates eagerly under ``--torch-compile true``.

    Usage::

        >>> ResumableTrainer(model=model, args=training_args, ...).train(resume_from_checkpoint=last)  # doctest: +SKIP
    """

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if (
            self.lr_scheduler is None
            and SchedulerType(self.args.lr_scheduler_type) == SchedulerType.WARMUP_STABLE_DECAY
        ):
            # TrainingArguments has parsed a --lr-scheduler-kwargs string into a dict by now.
            given = self.args.lr_scheduler_kwargs if isinstance(self.args.lr_scheduler_kwargs, dict) else {}
            self.args.lr_scheduler_kwargs = stable_decay_kwargs(given, num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # Under --torch-compile true the blocks are compiled for training steps. An evaluation calls them in eval mode
        # without gradients and, generating, with a cache that grows a token at a time: each changes a guard, so
        # dynamo compiled every block again (past its limit of 8 on the embedded T5) for a few percent of the run's
        # time. Evaluated eagerly, a compiled run compiles nothing after its first steps; uncompiled, nothing changes.
        with torch.compiler.set_stance("force_eager"):
            return super().evaluation_loop(*args, **kwargs)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        # The trainer checks for the end only after a step: resumed at max_steps it would take one more ("step 9/8").
        if self.state.global_step >= self.state.max_steps > 0:
            logger.warning(
                "resumed at step %d of %d: nothing left to train", self.state.global_step, self.state.max_steps
            )
            self.control.should_training_stop = True
            return
        super()._run_epoch(*args, **kwargs)


class KeptSchedule(TrainerCallback):
    """Record the peak learning rate a resumed run steps by: its checkpoint's, whatever this command line asked.

    The trainer restores a checkpoint's learning-rate schedule whole, so a run resumed with another
    ``--learning-rate``, or on another number of ranks (whose token batches scale the from-scratch recipe's rate),
    continues at the rate it started with: the same rate at the same step as had it never stopped. The run's recipe
    record (``run.json`` → ``recipe``) then says so, and the log tells the user once, with the way to another rate.

    :param record: the run's recipe record (:func:`textsql.planning.train_args.recipe_record`), updated in place.
    """

    def __init__(self, record: dict[str, Any]):
        self.record = record

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, lr_scheduler: Any = None, **kwargs: Any
    ) -> None:
        base_rates = getattr(lr_scheduler, "base_lrs", None)
        if not base_rates or math.isclose(max(base_rates), args.learning_rate):
            return
        kept = max(base_rates)
        logger.warning(
            "the checkpoint's schedule keeps its peak learning rate %g, not this command line's %g: a resumed run "
            "continues as it started; to train at %g, start a new run (another --run-dir)",
            kept,
            args.learning_rate,
            args.learning_rate,
        )
        self.record.update(peak_learning_rate=kept, asked_learning_rate=args.learning_rate, kept_from_checkpoint=True)


class GrammarGeneration:
    """Mixed into a ``Seq2SeqTrainer``: its generating evaluation writes only WikiSQL queries over each question's
    table. The bench's peer (``bench/accuracy.py``) is scored through it too, so both arms are evaluated alike.

    :param uncased: the model writes its queries in lower case (the ``uncased`` input format).
    """

    def __init__(self, *args: Any, uncased: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.uncased = uncased

    # transformers' own Seq2SeqTrainer returns a float | None loss where Trainer declares a Tensor | None:
    # this follows the Seq2SeqTrainer it is mixed into, which it calls.
    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[float | None, torch.Tensor | None, torch.Tensor | None]:
        trainer: Any = self  # a Seq2SeqTrainer, by the class this is mixed into
        if trainer.args.predict_with_generate and not prediction_loss_only:
            # The parent takes its stored keyword arguments only when it is given none.
            gen_kwargs = gen_kwargs or dict(getattr(trainer, "_gen_kwargs", {}))
            budget = generation_budget(gen_kwargs, trainer.model.generation_config)
            gen_kwargs["logits_processor"] = LogitsProcessorList(
                [processor_for_inputs(trainer.processing_class, inputs["input_ids"], budget, self.uncased)]
            )
        return super().prediction_step(  # type: ignore[misc]
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs
        )


# GrammarGeneration.prediction_step has Seq2SeqTrainer's signature, which Trainer's declares otherwise (above).
class GrammarSeq2SeqTrainer(GrammarGeneration, ResumableTrainer):  # type: ignore[misc]
    """The run's trainer: :class:`ResumableTrainer` evaluating through :class:`GrammarGeneration`.

    Usage::

        >>> trainer = GrammarSeq2SeqTrainer(model=model, args=training_args, processing_class=tokenizer, ...)  # doctest: +SKIP
    """
