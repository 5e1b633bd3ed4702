"""Training defaults chosen from the hardware in front of them: what the launching machine and every rank agree on.

:func:`fast_defaults` turns :class:`DeviceFacts` into ``textsql train`` defaults (every one can still be
overridden on the command line). On every device: the fused AdamW kernel (one pass over all parameters instead of
several per tensor; on a CPU, one thread, 120 steps of the small T5: 16.2 s -> 12.3 s of training unsharded, 16.6 s
-> 14.9 s under ZeRO-1, the same losses to three decimals). On CUDA also: TF32 matmuls on Ampere and newer, pinned
memory (copied to the GPU without blocking) and loader workers so the next batch is ready, no per-step NaN check (a host sync every step), batches filled to a
token budget sized from the GPU's memory, and evaluation and checkpoints spaced by time (their step grid alone
would run them every few seconds of training).

Not a default: ``torch.compile`` (``--torch-compile true`` turns it on, through the DeepSpeed engine). Measured on
one H200 with t5-small's shape (``bench/gpu_quick.json``), compiling the whole model took minutes and compiled again
on new batch shapes, so a compiled run finished sooner than an eager one only after thousands of steps: more than a
WikiSQL fine-tune of t5-small takes. A rank now compiles by regions, with dynamic sizes, into a cache that outlives
the pod (:mod:`textsql.training.compiling`); whether that makes compiling pay on a GPU is not measured yet, so it
stays off. Precision is not here:
``--precision auto`` already picks bf16 where the GPU supports it (``textsql.planning.train_args.resolve_precision``).

Already fast in transformers 5.23 and left alone: the training loss is accumulated on the device and
read with ``.item()`` only when it is logged.

Usage::

    >>> fast_defaults(DeviceFacts(cuda=False, cpu_cores=2))
    {'optim': 'adamw_torch_fused', 'dataloader_pin_memory': False}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

AMPERE = (8, 0)  # first compute capability with TF32 tensor cores
MAX_LOADER_WORKERS = 4
# Token budget per GiB of GPU memory. A first guess from t5-small at batch 256 (~22k padded tokens) on
# an 80 GB H100 with room to spare; not yet measured for larger models, hence the cap.
TOKENS_PER_GIB = 256
MAX_TOKENS_PER_BATCH = 32768
EVAL_SHARE = 0.05
SAVE_EVERY_MINUTES = 10.0


@dataclass(frozen=True)
class DeviceFacts:
    """What the defaults depend on; built by :func:`device_facts`, or by hand in tests.

    :param cuda: a CUDA GPU is present.
    :param compute_capability: the GPU's (major, minor).
    :param memory_gib: memory of one GPU.
    :param gpus: GPUs on this node (loader workers share the cores among their ranks).
    :param cpu_cores: cores of this node.
    """

    cuda: bool
    compute_capability: tuple[int, int] | None = None
    memory_gib: float | None = None
    gpus: int = 0
    cpu_cores: int = 1


def device_facts() -> DeviceFacts:
    """The facts of this machine (GPU 0 stands for all of a node's GPUs).

    :rtype: DeviceFacts
    """
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available():
        return DeviceFacts(cuda=False, cpu_cores=cores)
    properties = torch.cuda.get_device_properties(0)
    return DeviceFacts(
        cuda=True,
        compute_capability=(properties.major, properties.minor),
        memory_gib=properties.total_memory / 1024**3,
        gpus=torch.cuda.device_count(),
        cpu_cores=cores,
    )


def fast_defaults(facts: DeviceFacts) -> dict[str, Any]:
    """``textsql train`` defaults for this hardware (``Seq2SeqTrainingArguments`` names and ``max_tokens_per_batch``).

    :rtype: dict[str, typing.Any]
    """
    if not facts.cuda:
        # Pinning needs a GPU (torch warns without one).
        return {"optim": "adamw_torch_fused", "dataloader_pin_memory": False}
    workers = min(MAX_LOADER_WORKERS, max(1, facts.cpu_cores // max(facts.gpus, 1) - 1))
    defaults: dict[str, Any] = {
        "optim": "adamw_torch_fused",
        "dataloader_pin_memory": True,
        "dataloader_num_workers": workers,
        "dataloader_persistent_workers": True,
        # The trainer's NaN/inf filter reads the loss on the host at every step.
        "logging_nan_inf_filter": False,
        # Large token batches make a step-based schedule evaluate and checkpoint every few seconds
        # (textsql.training.schedule): evaluation kept to 5 % of the run, a checkpoint every 10 minutes.
        "eval_share": EVAL_SHARE,
        "save_every_minutes": SAVE_EVERY_MINUTES,
    }
    if facts.compute_capability and facts.compute_capability >= AMPERE:
        defaults["tf32"] = True
    if facts.memory_gib:
        defaults["max_tokens_per_batch"] = min(MAX_TOKENS_PER_BATCH, int(facts.memory_gib * TOKENS_PER_GIB) // 8 * 8)
    return defaults
