"""Where a few steady training steps spend their time, from ``torch.profiler``: how busy the device was and the
kernels that kept it busy.

:class:`Timeline` is a ``TrainerCallback`` that profiles ``steps`` consecutive optimizer steps from ``first_step``
inside the process that trains (the bench's own for the in-process arms; each rank through :mod:`bench.rank_probe`
for ``textsql launch``'s). On CUDA it records the device's activity (kernels, copies, memsets; not the device-side
copies of ``record_function`` ranges, as torch's own tables leave them out): the busy fraction is the union of
their intervals over the window's wall time, so kernels on two streams at once count once, and the top kernels
are ranked by their summed time. Without CUDA it reads the CPU's activity the same way (top-level ATen
operators for kernels), so a CPU rehearsal runs the same code but for which events it counts. Each top kernel
says where it was launched from (:func:`place`: the backward's autograd node or the forward, the operator the Python
code called and the one that launched it), most calls first, with that one's commonest first-input shapes. Profiling slows the
steps it watches: the arms profile steps after their timed window.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch.autograd import DeviceType
from transformers import TrainerCallback

from bench.steps import clock

logger = logging.getLogger(__name__)

WINDOW = "bench::timeline_window"
TOP_KERNELS = 10
NAME_CHARS = 160  # CUDA kernel names are C++ template instances, often thousands of characters
PLACES = 5  # the places a top kernel was launched from, most calls first
SHAPES = 3  # a place's commonest input shapes
# The profiler's range around each autograd node the backward runs ("...: MmBackward0").
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "


def busy_microseconds(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """The length of the union of ``intervals`` clipped to ``[start, end]`` (overlaps counted once).

    :rtype: float
    """
    busy, reached = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, reached), min(high, end)
        if high > low:
            busy += high - low
            reached = high
    return busy


def top_level_ops(events) -> list:
    """CPU events of ATen operators that no other ATen operator called: what the Python code dispatched.

    :rtype: list
    """

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False

    return [
        event
        for event in events
        if event.device_type == DeviceType.CPU and event.name.startswith("aten::") and not nested(event)
    ]


def place(event) -> tuple[str, str]:
    """Where an operator ran, ``NODE: TOP > OP``: the autograd node whose backward called it (``forward`` outside the
    backward), the top-level operator it ran under (left out when it is that one); and its first input's shape where
    the profiler recorded it (else "").

    :rtype: tuple[str, str]
    """
    node, top = "forward", event
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            top = parent
        elif parent.name.startswith(AUTOGRAD_NODE) and node == "forward":
            node = parent.name.removeprefix(AUTOGRAD_NODE)
        parent = parent.cpu_parent
    shapes = getattr(event, "input_shapes", None) or []
    return f"{node}: {top.name}{'' if top is event else ' > ' + event.name}", str(list(shapes[0])) if shapes else ""


def launch_places(events, device_activity: bool) -> dict[str, dict[str, Counter[str]]]:
    """For each kernel's name, each :func:`place` it was launched from and how many calls came from there with each
    input shape: on CUDA the operators the profiler linked each kernel to, on a CPU the top-level operators themselves.

    :rtype: dict[str, dict[str, collections.Counter[str]]]
    """
    places: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    launchers = (
        [(kernel.name, event) for event in events if event.device_type == DeviceType.CPU for kernel in event.kernels]
        if device_activity
        else [(event.name, event) for event in top_level_ops(events)]
    )
    for name, event in launchers:
        where, shape = place(event)
        places[name][where][shape] += 1
    return places


def summarize(events, steps: int, device_activity: bool) -> dict:
    """The window's busy fraction and top kernels.

    :param events: ``torch.profiler.profile(...).events()`` holding one :data:`WINDOW` range.
    :param device_activity: read the CUDA device's activity; else the CPU's top-level operators.
    :rtype: dict
    """
    (window,) = [event for event in events if event.name == WINDOW and event.device_type == DeviceType.CPU]
    start, end = window.time_range.start, window.time_range.end
    if device_activity:
        # Not the GPU-side copies of record_function ranges (this window's among them), which span kernels.
        active = [event for event in events if event.device_type == DeviceType.CUDA and not event.is_user_annotation]
    else:
        active = top_level_ops(events)
    intervals = [(event.time_range.start, event.time_range.end) for event in active]
    busy = busy_microseconds(intervals, start, end)
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in active:
        totals[event.name][0] += event.time_range.end - event.time_range.start
        totals[event.name][1] += 1
    ranked = sorted(totals.items(), key=lambda item: item[1][0], reverse=True)[:TOP_KERNELS]
    places = launch_places(events, device_activity)
    summed = sum(total for total, _ in totals.values())
    return {
        "activity": "CUDA kernels, copies and memsets" if device_activity else "CPU: top-level ATen operators",
        "steps": steps,
        "window_ms": round((end - start) / 1000, 3),
        "busy_ms": round(busy / 1000, 3),
        "busy_fraction": round(busy / (end - start), 4) if end > start else None,
        "kernels_per_step": round(len(active) / steps, 1),
        "top_kernels": [
            {
                "name": name[:NAME_CHARS],
                "total_ms": round(total / 1000, 3),
                "calls": calls,
                "share_of_kernel_time": round(total / summed, 4) if summed else None,
                "launched_by": [
                    {"place": where, "calls": sum(shapes.values()), "shapes": dict(shapes.most_common(SHAPES))}
                    for where, shapes in sorted(places[name].items(), key=lambda item: -sum(item[1].values()))[:PLACES]
                ],
            }
            for name, (total, calls) in ranked
        ],
    }


@contextlib.contextmanager
def profiled(steps: int) -> Iterator[dict]:
    """Profile what runs inside as ``steps`` steps: the device's activity where CUDA is in use, else the CPU's. The
    dict it yields holds :func:`summarize`'s figures once the block has ended.

    :rtype: Iterator[dict]
    """
    on_device = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    summary: dict = {}
    clock()  # the kernels queued before finish outside the window
    with (
        torch.profiler.profile(activities=activities, record_shapes=True) as profiler,
        torch.profiler.record_function(WINDOW),
    ):
        yield summary
        clock()  # the window ends when the last step's kernels have run
    summary.update(summarize(profiler.events(), steps, on_device))


class Timeline(TrainerCallback):
    """Profile optimizer steps ``first_step`` .. ``first_step + steps - 1`` (1-based) in :func:`profiled`;
    :attr:`summary` is then :func:`summarize`'s dict."""

    def __init__(self, first_step: int, steps: int):
        if first_step < 1 or steps < 1:
            raise ValueError(f"a timeline needs first_step >= 1 and steps >= 1, got {first_step}, {steps}")
        self.first_step, self.steps = first_step, steps
        self.summary: dict | None = None
        self._begun = 0
        # The window opens in one callback and closes in another.
        self._window: contextlib.ExitStack | None = None
        self._profiled: dict = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self._begun += 1
        if self._begun != self.first_step:
            return
        self._window = contextlib.ExitStack()
        self._profiled = self._window.enter_context(profiled(self.steps))

    def on_step_end(self, args, state, control, **kwargs):
        if self._window is None or self._begun != self.first_step + self.steps - 1:
            return
        self._window.close()
        self.summary, self._window = self._profiled, None
