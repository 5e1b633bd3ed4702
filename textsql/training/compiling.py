"""How a rank compiles under ``--torch-compile true``: each T5 block once, the compiled kernels kept for the next run,
and every batch's dimensions dynamic.

Compiling the whole model cost a run minutes before its first step (164 s on one H200 with t5-small's shape,
``bench/gpu_quick.json``), and every run paid it again. :func:`prepare_compilation` changes two things, both through
the libraries' own switches, and each can be turned back by setting its variable before the launch:

- **regional compilation** (accelerate's ``compile_regions_deepspeed``, switched on by
  ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION``): each ``T5Block`` is compiled in place instead of the whole
  model. The blocks of a stack run the same code, so dynamo traces a block once for each kind (the first of a
  stack computes the position bias) and Inductor compiles it once, not once per layer; the embedding, the final
  norms and the output layer are compiled apart, and the loss runs eagerly.
- **dynamic from the first compilation** (``ACCELERATE_DYNAMO_USE_DYNAMIC``): a block's inputs are the model's
  intermediate tensors, which :func:`mark_batch_dynamic` cannot reach, so dynamo would compile each block for the
  first batch's sizes, then again for the second's, in the middle of training.
- **a compile cache that outlives the pod**: Inductor keeps what it compiled under ``TORCHINDUCTOR_CACHE_DIR``,
  ``/tmp/torchinductor_USER`` by default, which a new worker pod does not have. Left unset, it becomes
  :func:`compile_cache_dir` (under the home directory, which on CML is the project's own storage and survives
  sessions and jobs), created private to its user: the cache holds code every rank imports and runs, so it lives
  where the project's code and virtual environment already do, never in the shared run directory.

``bench/compile_warmup.json`` (``python -m bench compile-warmup``) measures both on this machine's CPU: the first
step's time, cold and with the cache warm, whole model against regions, and the compilations after the first steps.

Evaluation runs eagerly (:meth:`textsql.training.trainer.ResumableTrainer.evaluation_loop`): its blocks run in eval
mode, without gradients and with a generation cache, each a guard the training graphs fail.

The batches are shaped for compilation too: :func:`mark_batch_dynamic` marks their dimensions dynamic, and the
sampler's compiled mode (:class:`textsql.training.batching.TokenBudgetBatchSampler`) gives each bucket one shape.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from textsql.constants import SOURCE_KEYS, TARGET_KEYS

logger = logging.getLogger(__name__)

REGIONAL_VAR = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"
DYNAMIC_VAR = "ACCELERATE_DYNAMO_USE_DYNAMIC"
CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir() -> Path:
    """Where a rank keeps torch.compile's compiled kernels unless ``TORCHINDUCTOR_CACHE_DIR`` says:
    ``$XDG_CACHE_HOME/textsql/torch-compile`` (``~/.cache/textsql/torch-compile``).

    :rtype: pathlib.Path
    """
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "textsql" / "torch-compile"


def prepare_compilation(torch_compile: bool) -> dict[str, str]:
    """Before the trainer exists: under ``torch_compile``, compile by regions, with dynamic sizes, and keep the compile
    cache in :func:`compile_cache_dir`, each where its variable is not already set; the three settings (nothing
    without ``torch_compile``).

    :rtype: dict[str, str]
    """
    if not torch_compile:
        return {}
    os.environ.setdefault(REGIONAL_VAR, "true")
    os.environ.setdefault(DYNAMIC_VAR, "true")
    if CACHE_VAR not in os.environ:
        cache = compile_cache_dir()
        try:
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.environ[CACHE_VAR] = str(cache)
        except OSError as error:  # a read-only home: torch's own default, in /tmp, still works
            logger.warning("torch.compile's cache stays in /tmp: %s (set %s where you launch)", error, CACHE_VAR)
    settings = {name: os.environ.get(name, "") for name in (REGIONAL_VAR, DYNAMIC_VAR, CACHE_VAR)}
    logger.info(
        "torch.compile: by regions %s, dynamic sizes %s, compile cache %s",
        *(settings[name] for name in (REGIONAL_VAR, DYNAMIC_VAR, CACHE_VAR)),
    )
    return settings


def mark_batch_dynamic(batch: dict[str, Any]) -> None:
    """Mark a batch's example and length dimensions dynamic for ``torch.compile``, before it sees the batch.

    Dynamo otherwise compiles the first shape as it is, then again with the dimensions that changed marked dynamic,
    and once more for each dimension that changes later (tests/test_batching.py counts them): the token-budget
    batches' shapes would compile two or three times. Marked, the first compilation serves them all. A dimension of
    size 1 stays as it is (dynamo specializes sizes 0 and 1).
    """
    for key in (*SOURCE_KEYS, *TARGET_KEYS):
        tensor = batch.get(key)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 1)
