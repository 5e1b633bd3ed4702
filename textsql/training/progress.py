"""The lines a training rank prints for a person: one per logged step, one per evaluation, the run's stage
line (model, ranks, profile), and a notice before DeepSpeed's one-off op compilation.

They replace the Trainer's tqdm bar, which reaches the launcher through pdsh as one ever-growing line,
and its raw ``{'loss': ...}`` dicts. Once the run's pace is steady each step line says the time left
(:mod:`textsql.training.time_left`), which ``run.json`` keeps too (``progress``). :mod:`textsql.console` shows exactly
these lines at the default log level; ``textsql demo`` turns ``step N/M`` into its terminal bar, and a notebook
into one progress bar (:mod:`textsql.display.step_bar`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from textsql.rank_lines import HEARTBEAT_INTERVAL_S, LAUNCH_ID_VAR, STAGE_PREFIX, heartbeat_line, step_line
from textsql.training.time_left import TimeLeft, steady_from
from worker.beats import Beat, send_beat
from worker.constants import ENV_BEAT_SOCKET

logger = logging.getLogger(__name__)

# DeepSpeed's CPU accelerator compiles its shared-memory collectives on the first launch on a machine.
SHM_OP_NAME = "deepspeed_shm_comm"
OP_BUILD_NOTICE = (
    STAGE_PREFIX + "compiling DeepSpeed's shared-memory communication op for CPU (once per machine, about "
    "2 min; cached in {root})"
)
# torch's build lock: while it exists every rank on the machine waits, and a compile killed midway never removes it.
OP_LOCK_NOTICE = (
    STAGE_PREFIX + "waiting on {lock}: another training on this machine is compiling DeepSpeed's CPU op, or a "
    "compile was killed and left it (nothing then ends the wait: if no cc1plus runs, delete the file)"
)


# Seconds between the lines that say the op is still compiling (the demo must never look stuck).
OP_BUILD_TICK_S = 10.0


class StepLines(TrainerCallback):
    """``step N/M: loss L`` on each logging step and ``step N/M: eval ...`` after each evaluation, on rank 0, each
    with the time left once the pace is steady (:mod:`textsql.training.time_left`), which :meth:`record` keeps for ``run.json``.

    :param evaluates: whether the run has an evaluation split (the steady window waits for its first evaluation).
    :param clock: seconds, monotonic.
    """

    def __init__(self, evaluates: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.evaluates, self.clock = evaluates, clock
        self.started = clock()
        self.time_left: TimeLeft | None = None
        # Whether trainer.train() is stepping: what comes after it (the final evaluation, the model's save) is no
        # pause of the run, so it is never observed.
        self.stepping = False
        # The time left said at each evaluation, for a person to check against the run's end.
        self.said_at_evaluations: list[dict[str, float | int | None]] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        eval_every = state.eval_steps if self.evaluates and args.eval_strategy == "steps" else None
        save_every = state.save_steps if args.save_strategy == "steps" else None
        self.time_left = TimeLeft(
            state.max_steps, steady_from(state.global_step, state.max_steps, eval_every, save_every)
        )
        self.stepping = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.stepping = False

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            text = f"loss {float(logs['loss']):.3f}"
        elif "eval_loss" in logs:
            text = "eval " + ", ".join(
                f"{name.removeprefix('eval_')} {float(value):.3f}"
                for name, value in logs.items()
                if name.startswith("eval_") and not name.endswith(("runtime", "per_second"))
            )
        else:
            return
        left = self._observe(state.global_step)
        if "eval_loss" in logs and self.stepping:
            self.said_at_evaluations.append(
                {"step": state.global_step, "elapsed_s": round(self.clock() - self.started, 1), "time_left_s": left}
            )
        print(step_line(state.global_step, state.max_steps, text, self.clock() - self.started, left), flush=True)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._observe(state.global_step)

    def _observe(self, step: int) -> float | None:
        if self.time_left is None or not self.stepping:  # logged outside trainer.train(): the final evaluation
            return None
        self.time_left.observe(step, self.clock())
        left = self.time_left.seconds_left()
        return None if left is None else round(left)

    def record(self) -> dict[str, Any] | None:
        """The run's pace for ``run.json``: where the steady window opened, its seconds a step (evaluations and
        checkpoints before the last step included, nothing after it), and the time left said at each evaluation
        during training; None before training began.

        :rtype: dict | None
        """
        if self.time_left is None:
            return None
        pace = self.time_left.seconds_per_step()
        return {
            "max_steps": self.time_left.max_steps,
            "steady_from_step": self.time_left.opened[0] if self.time_left.opened else None,
            "seconds_per_step": None if pace is None else round(pace, 4),
            "time_left_at_evaluations": self.said_at_evaluations,
            "ended_s": round(self.clock() - self.started, 1),
        }


def pace_record(trainer: Trainer) -> dict[str, Any] | None:
    """``run.json``'s ``progress``: what the trainer's :class:`StepLines` measured (:meth:`StepLines.record`).

    :param trainer: a trainer :func:`use_step_lines` set up.
    :rtype: dict | None
    """
    lines = next((each for each in trainer.callback_handler.callbacks if isinstance(each, StepLines)), None)
    return lines.record() if lines is not None else None


class Heartbeat(TrainerCallback):
    """Every rank's heartbeat line (:func:`textsql.rank_lines.heartbeat_line`) every ``interval_s``, from a
    thread of its own, so the supervisor can tell a stalled rank from one waiting for it
    (:mod:`textsql.launching.stall`). The count goes up with every step, evaluation batch and save. On a worker
    pod the same beat goes to the pod's agent too (:data:`worker.constants.ENV_BEAT_SOCKET`), which relays it
    to the supervisor signed (:mod:`worker.beats`): out of reach of what other hosts print."""

    def __init__(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.interval_s, self.step, self.progress = interval_s, 0, 0
        self._done = threading.Event()
        self._agent = os.environ.get(ENV_BEAT_SOCKET)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.step = state.global_step
        self.thread = threading.Thread(target=self._beat, args=(args.process_index,), name="heartbeat", daemon=True)
        self.thread.start()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.step, self.progress = state.global_step, self.progress + 1

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.progress += 1

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.progress += 1

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._done.set()

    def _beat(self, rank: int) -> None:
        # The first at once: the supervisor then knows every rank, even one stopped before its second beat.
        while True:
            step, progress = self.step, self.progress
            if self._agent:
                send_beat(self._agent, Beat(rank, step, progress))
            # One write, so the line never interleaves with the main thread's step lines.
            sys.stdout.write(heartbeat_line(rank, step, progress) + "\n")
            sys.stdout.flush()
            if self._done.wait(self.interval_s):
                return


def use_step_lines(trainer: Trainer) -> None:
    """Replace the Trainer's progress bar and dict printer with :class:`StepLines`; add the :class:`Heartbeat` under
    ``textsql launch``.

    :param trainer: a ``transformers.Trainer``.
    """
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepLines(evaluates=trainer.eval_dataset is not None))
    # Only a launch has a supervisor to read the heartbeat; `textsql train` in a terminal stays quiet.
    if os.environ.get(LAUNCH_ID_VAR):
        trainer.add_callback(Heartbeat())


def announce_run(model: str, profile: str, auto: bool, world_size: int, precision: str) -> None:
    """The run's stage line (rank 0 calls it): what trains, on how many ranks, with which profile and precision.

    :param model: the model argument.
    :param profile: the profile the run uses (``auto`` already resolved).
    :param auto: whether ``auto`` chose it.
    :param world_size: ranks in the run.
    :param precision: the resolved precision.
    """
    from textsql.planning.profiles import get_profile

    how = "; auto: the cheapest that fits" if auto else ""
    print(
        f"{STAGE_PREFIX}training {model} on {world_size} rank(s): profile {profile} (ZeRO-{get_profile(profile).stage}{how}), {precision}",
        flush=True,
    )


def build_ops_with_pinned_ninja() -> None:
    """Put this interpreter's own ``ninja`` (requirements.txt pins it) first on ``PATH`` for DeepSpeed's op builds.

    torch compiles an op with whichever ``ninja`` ``PATH`` finds first, and ninja releases record their builds
    differently: a cache that one (1.13, pinned) built is compiled again from scratch by another (Debian's 1.11 says
    "command line changed"), about 20 s before the first step each time the two alternate, e.g. a launch (its ranks
    get the environment's tools first) after ``.venv/bin/textsql train`` from a shell whose ``PATH`` has Debian's.
    Nothing changes where the interpreter's directory holds no ``ninja``.
    """
    own = Path(sys.executable).parent
    if (own / "ninja").exists() and shutil.which("ninja") != str(own / "ninja"):
        os.environ["PATH"] = os.pathsep.join([str(own), os.environ.get("PATH", "")])


def announce_op_build() -> None:
    """Say what the coming silence is before DeepSpeed compiles its CPU op, once per machine.

    Only the first rank of each host speaks (the others wait on the same build); nothing is said where a
    GPU is used or the op is already in the extensions cache, unless the cache's build lock is there already.
    """
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("LOCAL_RANK", "0") != "0" or torch.cuda.is_available():
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    for lock in root.glob(f"**/{SHM_OP_NAME}/lock"):
        print(OP_LOCK_NOTICE.format(lock=lock), flush=True)
    if not op_built(root):
        print(OP_BUILD_NOTICE.format(root=root), flush=True)
        # The build prints nothing for minutes: a line every few seconds says it is still going.
        threading.Thread(target=tick_while_building, args=(root,), name="op-build-ticks", daemon=True).start()


def op_built(root: Path) -> bool:
    """Whether DeepSpeed's CPU op is in the extensions cache under ``root``.

    :rtype: bool
    """
    return any(root.glob(f"**/{SHM_OP_NAME}/{SHM_OP_NAME}*.so"))


def tick_while_building(root: Path, interval_s: float = OP_BUILD_TICK_S) -> None:
    """Print how long the op has been compiling every ``interval_s`` until it is in the cache under ``root``.

    :param root: the extensions cache.
    :param interval_s: seconds between lines.
    """
    started = time.monotonic()
    while True:
        time.sleep(interval_s)
        if op_built(root):
            return
        print(f"{STAGE_PREFIX}still compiling DeepSpeed's CPU op: {time.monotonic() - started:.0f} s", flush=True)
