"""When each training step was logged, from the TensorBoard event files the run wrote."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

LOSS_TAG = "train/loss"


def step_wall_times(tensorboard_dir: Path, tag: str = LOSS_TAG) -> list[tuple[int, float]]:
    """``(step, wall time)`` of every logged value of ``tag`` (run with ``--logging_steps 1`` for every step).

    :param tensorboard_dir: the run's ``tensorboard/`` folder (searched recursively).
    :rtype: list[tuple[int, float]]
    """
    return [(step, wall_time) for step, wall_time, _ in scalars(tensorboard_dir, tag)]


def scalars(tensorboard_dir: Path, tag: str = LOSS_TAG) -> list[tuple[int, float, float]]:
    """``(step, wall time, value)`` of every logged value of ``tag``, by step.

    :rtype: list[tuple[int, float, float]]
    """
    from tensorboard.backend.event_processing import event_accumulator, event_multiplexer

    multiplexer = event_multiplexer.EventMultiplexer(size_guidance={event_accumulator.SCALARS: 0})
    multiplexer.AddRunsFromDirectory(str(tensorboard_dir)).Reload()
    found = [
        (event.step, event.wall_time, event.value)
        for run, tags in multiplexer.Runs().items()
        if tag in tags["scalars"]
        for event in multiplexer.Scalars(run, tag)
    ]
    if not found:
        raise RuntimeError(f"no {tag!r} events under {tensorboard_dir}; did the run log any step?")
    return sorted(found)


def samples_per_second(times: list[tuple[int, float]], samples_per_step: int, skip_steps: int) -> float:
    """Throughput between the end of step ``skip_steps`` and the last logged step.

    :param times: from :func:`step_wall_times`.
    :param samples_per_step: global batch (per-rank batch x ranks x accumulation).
    :param skip_steps: warm-up steps left out (DeepSpeed and allocator set-up in the first ones).
    :rtype: float
    """
    (first_step, first_time), (last_step, last_time) = next(t for t in times if t[0] >= skip_steps), times[-1]
    if last_step <= first_step:
        raise RuntimeError(f"only steps up to {last_step} logged; run more than {skip_steps} steps")
    return (last_step - first_step) * samples_per_step / (last_time - first_time)


def scalars_per_file(tensorboard_dir: Path, tag: str = LOSS_TAG) -> list[dict[int, float]]:
    """``{step: value}`` of ``tag`` in each event file on its own, oldest file first: a resumed run writes
    a new file, and reading them apart keeps the values it rewound past (TensorBoard's own view drops them).

    :param tensorboard_dir: the run's ``tensorboard/`` folder (searched recursively).
    :rtype: list[dict[int, float]]
    """
    from tensorboard.backend.event_processing import event_accumulator

    files = sorted(tensorboard_dir.rglob("events.out.tfevents.*"), key=lambda path: path.name.split(".")[3])
    found = []
    for path in files:
        accumulator = event_accumulator.EventAccumulator(
            str(path), size_guidance={event_accumulator.SCALARS: 0}, purge_orphaned_data=False
        ).Reload()
        if tag in accumulator.Tags()["scalars"]:
            found.append({event.step: event.value for event in accumulator.Scalars(tag)})
    return found
