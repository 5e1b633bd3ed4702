"""The command line of a tiny training run with evaluation every N steps; the tests build theirs with it too.

A tiny run trains for a handful of steps on batches of 4, logs every step and draws no progress bar; when it
evaluates during training, it scores a few held-out questions with short generations. The bench
(:mod:`bench.pretrained_proxy`, :mod:`bench.profiles`) and the tests that really train (``tests/test_tensorboard.py``,
``test_model_card.py``, ``test_tracking.py``, ``test_train_distributed.py`` ...) call :func:`tiny_run_argv` and pass
only what their run does differently. It lives in ``bench/`` because the bench must not import ``tests/``,
while the tests import the bench already.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textsql.arguments import train_argv

# What every tiny run shares: small batches, every step in the log, no bar in a captured output.
TINY_RUN: dict[str, Any] = {"per_device_train_batch_size": 4, "logging_steps": 1, "disable_tqdm": True}
# An evaluation during training kept short: a few questions, generations cut at 24 tokens.
TINY_EVALUATION: dict[str, Any] = {"max_eval_samples": 8, "generation_max_length": 24}


def tiny_run_argv(
    data_dir: str | Path, output_dir: str | Path, *, max_steps: int, eval_every: int | None, **overrides: Any
) -> list[str]:
    """The ``textsql train`` command line (:func:`textsql.arguments.train_argv`) of a tiny run of ``max_steps``
    steps on the prepared data in ``data_dir``, writing into ``output_dir``.

    Usage::

        >>> tiny_run_argv("data", "out", max_steps=4, eval_every=2, save_steps=4)
        ['--data-dir', 'data', '--run-dir', 'out', '--max-steps', '4', '--per-device-train-batch-size', '4', '--logging-steps', '1', '--disable-tqdm', 'true', '--eval-steps', '2', '--max-eval-samples', '8', '--generation-max-length', '24', '--save-steps', '4']

    :param eval_every: evaluate every this many steps, on :data:`TINY_EVALUATION`'s terms; ``None``: no
        evaluation during training (the one after the last step still runs, on the trainer's terms).
    :param overrides: any other training argument, or one of the tiny run's with another value; ``None``
        leaves the flag out, so the run gets that argument's default.
    :raises LaunchError: for a name that is no training argument.
    :rtype: list[str]
    """
    evaluation = {"eval_strategy": "no"} if eval_every is None else {"eval_steps": eval_every, **TINY_EVALUATION}
    values = {"data_dir": data_dir, "run_dir": output_dir, "max_steps": max_steps, **TINY_RUN, **evaluation}
    return train_argv(**(values | overrides))
