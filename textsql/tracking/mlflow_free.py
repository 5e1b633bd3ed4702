"""DeepSpeed imported without MLflow, for the processes of a run that never track: DeepSpeed's runner and the
per-node launcher on each host (:mod:`textsql.launching.deepspeed_entry`), every rank before it knows
whether it tracks (:func:`textsql.training.train.main`), and the memory estimate (``textsql estimate``, notebook 02:
:meth:`textsql.planning.profiles.Profile.memory`).

DeepSpeed 0.19.8's autotuner imports MLflow whenever MLflow is installed, and every ``import deepspeed`` imports
the autotuner: 1.2-1.5 CPU seconds of each such process's start (measured on 2 cores), for a tool none of them uses.
"""

from __future__ import annotations

import sys


def import_deepspeed_lean() -> None:
    """Import DeepSpeed without the MLflow its autotuner imports.

    With ``sys.modules["mlflow"]`` set to ``None`` the autotuner's ``import mlflow`` raises the ``ImportError`` it
    already falls back on; the entry is then removed, so a rank that tracks to MLflow imports it later as usual.
    Nothing is done where either is already imported (a notebook kernel).
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]
