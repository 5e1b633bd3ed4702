"""Per-step timing and op counts of a training run, taken inside the process that trains.

:class:`StepClock` is a ``TrainerCallback``: it records when each optimizer step began and ended and when
each evaluation ran, and profiles one chosen step with ``torch.profiler`` on the CPU. Both arms of the
GPU bench use it (the old recipe in this process, ours on its rank through :mod:`bench.rank_probe`), so
their samples/s exclude the same warm-up steps and their time to an eval loss is measured the same way.

Op counts (:func:`count_ops`) read the profiler's event tree:

- *ops*: top-level ATen operators (an ``aten::`` event with no ``aten::`` ancestor), i.e. what the Python
  code dispatched, each a kernel launch or more on a GPU;
- *compute ops*: the operators that do the work, about one GPU kernel each: ATen operators with no ``aten::``
  child that are neither views nor allocations, and a multi-tensor operator (``_foreach_*``, ``_fused_*``) once,
  as a GPU launches it (a CPU loops over its tensors inside). A CPU runs a few operators as several that a GPU
  runs as one (SDPA's math path, RMS norm's backward, dropout), alike in every arm;
- *host syncs*: ``aten::_local_scalar_dense`` called from Python, what ``.item()``, ``float()``, ``bool()``
  and ``if tensor:`` dispatch to read a value on the host (on CUDA each waits for the GPU), plus calls of the
  accelerator's ``synchronize`` (counted by :func:`phase_markers`). Reads inside another operator's CPU
  kernel are not counted (torch's fused AdamW reads each step count on the CPU; its CUDA kernel does
  not); a ``.cpu()`` copy is invisible on a CPU run;
- *reduce calls*: top-level ``c10d::`` collectives that reduce (all-reduce, reduce-scatter);
- the *optimizer phase*: the events under the markers :func:`phase_markers` puts around DeepSpeed's
  ``engine.step`` (clipping, optimizer, ZeRO's flat copies) and the trainer's own clipping, optimizer,
  scheduler and ``zero_grad`` calls, so both arms count the same work.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import numbers
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)

OPTIMIZER_PHASE = "bench::optimizer_phase"
HOST_SYNC_OPS = ("aten::_local_scalar_dense",)
# The operators through which Python reads a scalar (tensor.item(), bool(tensor)); a read under any other
# operator is that operator's CPU kernel at work.
HOST_READS = ("aten::item", "aten::is_nonzero")
SYNC_CALLS = "bench::synchronize"
# Operators that launch one kernel (or a few) on a GPU for any number of tensors.
MULTI_TENSOR_OPS = ("aten::_foreach_", "aten::_fused_")
# Operators that compute nothing: they allocate, or view what is there (views torch's schemas do not mark as such).
NO_WORK = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"})


def clock() -> float:
    """``time.perf_counter()`` once the GPU has done what was queued: a CUDA step returns to Python before its kernels
    finish, so a read without waiting would time the launches, not the step (no wait where CUDA is not in use).

    :rtype: float
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


@dataclass
class StepClock(TrainerCallback):
    """Wall times of every optimizer step and evaluation, with each evaluation's scores; op counts of step
    ``profile_step`` (1-based; 0: none). Training stops at the first evaluation whose loss is at or below
    ``stop_below``, or whose ``stop_at`` metric (name, value) is at or above the value, or at the first step's end
    ``time_cap_s`` seconds after the first step began."""

    profile_step: int = 0
    stop_below: float | None = None
    stop_at: tuple[str, float] | None = None
    time_cap_s: float | None = None
    step_began: list[float] = field(default_factory=list)
    step_ended: list[float] = field(default_factory=list)
    # torch.compile's graphs compiled so far (dynamo's count, recompilations included) at each step's end.
    graphs_compiled: list[int] = field(default_factory=list)
    evaluations: list[dict] = field(default_factory=list)
    ops: dict | None = None

    def __post_init__(self) -> None:
        self._profiler = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_began.append(clock())
        if len(self.step_began) == self.profile_step:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.ops = count_ops(self._profiler.events())
            self._profiler = None
        self.step_ended.append(clock())
        self.graphs_compiled.append(graphs_compiled())
        if self.time_cap_s is not None and self.step_ended[-1] - self.step_began[0] >= self.time_cap_s:
            control.should_training_stop = True

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        # The evaluation runs right after its step's end (the trainer's _maybe_log_save_evaluate).
        ended = clock()
        # The scores, as JSON numbers (numpy's too); not the epoch, a count.
        scores = {
            name: float(value)
            for name, value in (metrics or {}).items()
            if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
        }
        self.evaluations.append(
            {
                "step": state.global_step,
                "eval_loss": (metrics or {}).get("eval_loss"),
                "seconds": ended - self.step_ended[-1] if self.step_ended else 0.0,
                "metrics": scores,
            }
        )
        loss = self.evaluations[-1]["eval_loss"]
        if self.stop_below is not None and loss is not None and loss <= self.stop_below:
            control.should_training_stop = True
        if self.stop_at is not None and scores.get(self.stop_at[0], -math.inf) >= self.stop_at[1]:
            control.should_training_stop = True

    def record(self) -> dict:
        """What the clock saw, as JSON (a rank writes it to its probe file).

        :rtype: dict
        """
        return {
            "step_began": self.step_began,
            "step_ended": self.step_ended,
            "graphs_compiled": self.graphs_compiled,
            "evaluations": self.evaluations,
            "ops": self.ops,
        }


def graphs_compiled() -> int:
    """The graphs torch.compile has compiled in this process so far, each recompilation one more (dynamo's
    counter; 0 where nothing compiled).

    :rtype: int
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compilations_after(record: dict, skip: int) -> int:
    """The graphs torch.compile compiled after the end of step ``skip`` (a warm-up's end): each one a stall in the
    middle of training.

    :param record: :meth:`StepClock.record`.
    :rtype: int
    """
    counts = record["graphs_compiled"]
    return counts[-1] - counts[skip - 1]


def timed_window(record: dict, skip: int) -> tuple[int, float]:
    """(steps, seconds) from the end of step ``skip`` to the end of the last timed step.

    :param record: :meth:`StepClock.record`; a profiled last step is left out of the window.
    :param skip: warm-up steps left out (at least 1, so the window starts at a step's end, like it ends).
    :raises ValueError: fewer than ``skip + 1`` timed steps, naming what to change.
    :rtype: tuple[int, float]
    """
    ended = record["step_ended"][: -1 if record.get("ops") else None]
    if skip < 1 or len(ended) <= skip:
        raise ValueError(
            f"{len(ended)} timed step(s) with {skip} warm-up step(s) skipped; "
            "run at least one step more than the warm-up (bench Sizes: warmup_steps >= 1, timed_steps >= 1)"
        )
    return len(ended) - skip, ended[-1] - ended[skip - 1]


def step_times(record: dict, skip: int) -> dict:
    """How long the warm-up took (from the first step's start: compilation falls here) and the median and slowest
    step of the timed window (end to end, so loading the next batch counts), in seconds.

    :param record: :meth:`StepClock.record`, as for :func:`timed_window`.
    :rtype: dict
    """
    steps, _ = timed_window(record, skip)
    ended = record["step_ended"][skip - 1 : skip + steps]
    durations = [later - earlier for earlier, later in itertools.pairwise(ended)]
    return {
        "warmup_steps": skip,
        "timed_steps": steps,
        "warmup_s": round(ended[0] - record["step_began"][0], 3),
        "median_step_s": round(statistics.median(durations), 4),
        "slowest_step_s": round(max(durations), 4),
    }


def training_seconds_to(record: dict, target: float) -> float | None:
    """Training time from the first step's start to the end of the step whose evaluation first reached
    ``target``, less the evaluations before it; ``None`` if none reached it.

    :rtype: float | None
    """
    spent_evaluating = 0.0
    for evaluation in record["evaluations"]:
        loss = evaluation["eval_loss"]
        if loss is not None and loss <= target:
            return record["step_ended"][evaluation["step"] - 1] - record["step_began"][0] - spent_evaluating
        spent_evaluating += evaluation["seconds"]
    return None


def count_ops(events) -> dict:
    """Ops, host syncs and reduce calls of a profiled step, in all and in the optimizer phase.

    :param events: ``torch.profiler.profile(...).events()``.
    :rtype: dict
    """

    def ancestors(event) -> Iterator:
        parent = event.cpu_parent
        while parent is not None:
            yield parent
            parent = parent.cpu_parent

    counts = {
        "ops": 0,
        "compute_ops": 0,
        "host_syncs": 0,
        "reduce_calls": 0,
        "optimizer_ops": 0,
        "optimizer_host_syncs": 0,
    }
    optimizer_names: Counter[str] = Counter()
    sync_places: Counter[str] = Counter()
    for event in events:
        names = [parent.name for parent in ancestors(event)]
        in_optimizer = OPTIMIZER_PHASE in names
        from_python = all(name in HOST_READS for name in names if name.startswith("aten::"))
        if event.name == SYNC_CALLS or (event.name in HOST_SYNC_OPS and from_python):
            counts["host_syncs"] += 1
            sync_places[" < ".join(name for name in names if not name.startswith("aten::")) or "(top level)"] += 1
            counts["optimizer_host_syncs"] += in_optimizer
        if event.name.startswith("aten::") and not any(name.startswith(MULTI_TENSOR_OPS) for name in names):
            counts["compute_ops"] += event.name.startswith(MULTI_TENSOR_OPS) or (
                not any(child.name.startswith("aten::") for child in event.cpu_children) and _computes(event.name)
            )
        if event.name.startswith("aten::") and not any(name.startswith("aten::") for name in names):
            counts["ops"] += 1
            counts["optimizer_ops"] += in_optimizer
            if in_optimizer:
                optimizer_names[event.name] += 1
        if (
            event.name.startswith("c10d::")
            and "reduce" in event.name
            and not any(name.startswith("c10d::") for name in names)
        ):
            counts["reduce_calls"] += 1
    return {
        **counts,
        "optimizer_ops_by_name": dict(optimizer_names.most_common()),
        "host_syncs_under": dict(sync_places.most_common()),
    }


@functools.cache
def _computes(name: str) -> bool:
    """Whether an ATen operator (``aten::name``) computes: not an allocation, and not a view in any overload."""
    operator = name.removeprefix("aten::")
    if operator in NO_WORK:
        return False
    packet = getattr(torch.ops.aten, operator, None)
    overloads = [getattr(packet, overload) for overload in packet.overloads()] if packet is not None else []
    return not any(
        returned.alias_info is not None and not returned.alias_info.is_write
        for overload in overloads
        for returned in overload._schema.returns
    )


def _marked(method, name: str = OPTIMIZER_PHASE):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return method(*args, **kwargs)

    wrapper.__bench_marked__ = True
    return wrapper


@contextlib.contextmanager
def phase_markers() -> Iterator[None]:
    """Mark the optimizer phase of a step for :func:`count_ops`, and count accelerator synchronizations.

    Wraps (for this process, until the block ends) DeepSpeed's ``engine.step``, the trainer's clipping and
    grad-norm read, the optimizer wrapper's ``step``, the scheduler's ``step`` and ``Module.zero_grad``
    in a profiler range, and DeepSpeed's accelerator ``synchronize`` in a :data:`SYNC_CALLS` range.
    """
    from accelerate.optimizer import AcceleratedOptimizer
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import Trainer

    accelerator = type(get_accelerator())
    targets = [
        (DeepSpeedEngine, "step", OPTIMIZER_PHASE),
        (Trainer, "_clip_grad_norm", OPTIMIZER_PHASE),
        (Trainer, "_get_grad_norm", OPTIMIZER_PHASE),
        (AcceleratedOptimizer, "step", OPTIMIZER_PHASE),
        (torch.optim.lr_scheduler.LRScheduler, "step", OPTIMIZER_PHASE),
        (torch.nn.Module, "zero_grad", OPTIMIZER_PHASE),
        (accelerator, "synchronize", SYNC_CALLS),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, label in targets:
        method = getattr(owner, name)
        if not getattr(method, "__bench_marked__", False):
            setattr(owner, name, _marked(method, label))
    try:
        yield
    finally:
        for owner, name, method in saved:
            setattr(owner, name, method)
