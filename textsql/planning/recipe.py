"""The learning-rate recipe a model trains with unless flags say otherwise, chosen by what the model is.

A model built from its config (random weights) and one loaded with trained weights want different rates,
schedules and warm-ups (docs/guides/gpus.md): :func:`training_recipe` is the one place that decides, the
training command line (:mod:`textsql.planning.train_args`) sets its values as defaults that any of
``--learning-rate``, ``--lr-scheduler-type`` and ``--warmup-steps`` overrides, and ``run.json`` records it.
Nothing heavy is imported here, so ``textsql --help`` can quote the rates.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """How a run's optimizer steps: the learning rate, its schedule and warm-up, and why (``run.json``'s ``recipe``).

    :param name: what the recipe is called in ``run.json`` and the log.
    :param learning_rate: the peak rate (``--learning_rate``).
    :param schedule: ``--lr_scheduler_type``.
    :param warmup: ``--warmup_steps``: a step count, or below 1 a share of the run's steps.
    :param why: why a model of this kind trains with it, and where the recipe comes from.
    """

    name: str
    learning_rate: float
    schedule: str
    warmup: float
    why: str

    def training_values(self) -> dict[str, Any]:
        """The ``Seq2SeqTrainingArguments`` values this recipe sets (each one a default the command line overrides).

        :rtype: dict[str, typing.Any]
        """
        return {"learning_rate": self.learning_rate, "lr_scheduler_type": self.schedule, "warmup_steps": self.warmup}


# Both recipes step with AdamW (the optimizer device_defaults.fast_defaults picks: torch's, fused on CUDA), the one every
# DeepSpeed profile runs, CPU Adam under offload among them.
FROM_CONFIG_RECIPE = Recipe(
    name="from-scratch",
    learning_rate=1e-3,
    schedule="warmup_stable_decay",
    warmup=0,
    why="built from its config (random weights): the rate the demo learns with. The small T5 from random weights "
    "first memorises its training questions and only then reads their headers; decayed linearly to 0 over the demo's "
    "2,000 steps it stopped at 6.5 % held-out logical form, held constant at 1e-3 (T5's own fine-tuning rate, "
    "Raffel et al. 2020, section 3.1.2) it reached 52.5 %. Held constant, then decayed linearly to 0 over the last "
    "fifth of the steps (warmup-stable-decay, Hu et al. 2024; Hägele et al. 2024) it reached 75.6 % where the "
    "constant rate reached 68.2 % (docs/explanation/training-defaults.md)",
)
FROM_CONFIG_TOKEN_BATCHES_RECIPE = Recipe(
    name="from-scratch-token-batches",
    learning_rate=FROM_CONFIG_RECIPE.learning_rate,
    schedule="warmup_stable_decay",
    warmup=0.06,
    why="built from its config (random weights) and batched to a token budget (a GPU's default: hundreds of "
    "questions a step): the from-scratch recipe's rate scaled by the square root of the tokens a step over the "
    "demo's 2,560 (Adam's square-root rule, Malladi et al. 2022), from 1e-3 up to 3.58e-3 at 32,768 tokens and no "
    "further: at 32,768 tokens a step the demo's rate left the model far below the demo's target where the scaled "
    "one reached it (bench/rate_scaling.json); at 65,536 the rule's 5.06e-3 left it near 0 "
    "(bench/rate_scaling_65536.json). The rate is reached by a linear warm-up over the first 6 % of the steps. "
    "AdamW's first updates from random weights are its largest (its moment estimates start from a single batch), "
    "and at the full rate on large batches in bf16 they can set a transformer's training off course; a warm-up is "
    "the usual remedy (Vaswani et al. 2017; Popel and Bojar 2018 on larger batches). Then, as the from-scratch "
    "recipe, held and decayed linearly to 0 over the last fifth of the steps: held to the end instead, the demo's "
    "model levelled off below the demo's target (bench/time_to_accuracy_held_rate.json)",
)
WITH_WEIGHTS_RECIPE = Recipe(
    name="pretrained-t5",
    learning_rate=3e-4,
    schedule="linear",
    warmup=0.06,
    why="loads trained weights (a hub id or a directory with weights): AdamW at 3e-4, the top of the 1e-4 to 3e-4 "
    "that transformers' T5 documentation gives for fine-tuning pretrained T5 with AdamW (its 'Training tips'), "
    "warmed up linearly over the first 6 % of the steps and decayed linearly to 0 (transformers' linear schedule; "
    "the warm-up share of RoBERTa's fine-tuning, Liu et al. 2019). T5's authors' constant 1e-3 is Adafactor's "
    "rate, not AdamW's, and at full rate from the first step AdamW's first updates move pretrained weights most",
)


# The share of a run's steps over which ``warmup_stable_decay`` takes the rate to 0, when --lr-scheduler-kwargs
# does not say: the last fifth, as the schedule's authors found enough to match a cosine schedule's loss.
DECAY_SHARE = 0.2


def stable_decay_kwargs(given: dict[str, Any], training_steps: int) -> dict[str, Any]:
    """``warmup_stable_decay``'s scheduler arguments: those given, and for the rest a linear decay over the last
    :data:`DECAY_SHARE` of the run's steps (transformers asks for a step count, known only once the trainer has one).

    Usage::

        >>> stable_decay_kwargs({}, 2000)
        {'num_decay_steps': 400, 'decay_type': 'linear'}

    :param given: ``--lr-scheduler-kwargs``.
    :param training_steps: the run's optimizer steps.
    :rtype: dict[str, typing.Any]
    """
    return {"num_decay_steps": max(1, round(DECAY_SHARE * training_steps)), "decay_type": "linear", **given}


# The tokens a step the from-scratch rate was chosen at (the demo's, about 30 questions), and the most a rate scaled
# from it reached the demo's target at (bench/rate_scaling.json): past those, a larger batch raises the rate no further
# (at 65,536 tokens the rule's 5.06e-3 left the model near 0 held-out logical form: bench/rate_scaling_65536.json).
RATE_CHOSEN_AT_TOKENS = 2560
RATE_MEASURED_UP_TO_TOKENS = 32768


def square_root_scaled(rate: float, tokens_a_step: int) -> float:
    """``rate``, chosen at :data:`RATE_CHOSEN_AT_TOKENS` tokens a step, scaled to ``tokens_a_step`` by the square
    root of the batch's growth (Adam's square-root rule, Malladi et al. 2022), to three significant digits. Neither
    lowered for smaller batches nor raised past :data:`RATE_MEASURED_UP_TO_TOKENS`: no rate outside was measured.

    Usage::

        >>> square_root_scaled(1e-3, 32768), square_root_scaled(1e-3, 4 * 32768), square_root_scaled(1e-3, 1024)
        (0.00358, 0.00358, 0.001)

    :rtype: float
    """
    tokens = min(max(tokens_a_step, RATE_CHOSEN_AT_TOKENS), RATE_MEASURED_UP_TO_TOKENS)
    return float(f"{rate * math.sqrt(tokens / RATE_CHOSEN_AT_TOKENS):.3g}")


def training_recipe(builds_from_config: bool, tokens_a_step: int | None = None) -> Recipe:
    """The recipe a model trains with unless flags say otherwise: the one place that decides it.

    Usage::

        >>> training_recipe(builds_from_config=False).learning_rate
        0.0003
        >>> recipe = training_recipe(builds_from_config=True, tokens_a_step=16384)
        >>> recipe.name, recipe.learning_rate, recipe.warmup
        ('from-scratch-token-batches', 0.00253, 0.06)

    :param builds_from_config: the model is built from its config (:func:`textsql.model.builds_from_config`).
    :param tokens_a_step: the tokens of one optimizer step over all ranks when batches are filled to a token budget
        (``--max-tokens-per-batch``, a GPU's default); ``None`` for batches of questions.
    :rtype: Recipe
    """
    if not builds_from_config:
        return WITH_WEIGHTS_RECIPE
    if tokens_a_step is None:
        return FROM_CONFIG_RECIPE
    rate = square_root_scaled(FROM_CONFIG_TOKEN_BATCHES_RECIPE.learning_rate, tokens_a_step)
    return dataclasses.replace(FROM_CONFIG_TOKEN_BATCHES_RECIPE, learning_rate=rate)
