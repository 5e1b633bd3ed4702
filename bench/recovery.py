"""Recovery from a lost rank on the local backend: detection time, downtime and repeated steps.

Two `local` worker pods (each its own sshd, on 127.0.0.2 and 127.0.0.3) train the embedded small T5
(profile zero1, one rank per pod, every step logged) under the supervisor (:mod:`textsql.launching.supervisor`).
Once checkpoint-K is complete and step ``kill_after_step`` is logged, rank 1's training process is
sent SIGKILL, as the OOM killer would: found by its rank and this run's tag in its environment, not
by name. The figures come from the kill's own clock and the supervisor's records (``supervisor.json``):

- detection: kill to the supervisor's first sign of the failure on the launch's stream;
- downtime: kill to the first step the relaunched run logged;
- repeated steps: the last step logged before the kill less the checkpoint the run resumed from.

The helpers that find and kill a rank, and the stream that says when a step was logged, are the ones
tests/test_recovery.py uses too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.profiles import train_only
from bench.timing import summary
from textsql.arguments import train_argv
from textsql.constants import DEFAULT_MODEL_DIR
from textsql.json_files import read_json
from textsql.launching.command import LaunchArguments
from textsql.launching.failures import FailureKind
from textsql.launching.recovery import SUPERVISOR_FILE
from textsql.launching.supervisor import supervise
from textsql.rank_lines import STEP_LINE
from textsql.rundir.checkpoints import COMPLETE_MARKER

logger = logging.getLogger(__name__)

# Put in every rank's environment, so this run's processes are told from any other's.
TAG_VAR = "TEXTSQL_RECOVERY_TAG"
PROFILE = "zero1"
KILLED_RANK = 1
WAIT_S = 600.0


@dataclass(frozen=True)
class Sizes:
    """One supervised run per repetition: ``steps`` in all, a checkpoint every ``save_steps``, the kill
    once step ``kill_after_step`` is logged (``kill_after_step - save_steps`` steps after a checkpoint)."""

    steps: int = 12
    save_steps: int = 4
    kill_after_step: int = 6
    batch_size: int = 8
    repetitions: int = 2


class StepStream(io.TextIOBase):
    """The supervised launch's stream: keeps every line (and appends it to ``log``), and lets another
    thread wait until a step is logged."""

    def __init__(self, log: Path | None = None) -> None:
        """
        :param log: a file to append the lines to as well (None: memory only).
        """
        super().__init__()
        self.parts: list[str] = []
        self.steps: list[int] = []
        self._partial = ""
        self._logged = threading.Condition()
        self._log = open(log, "a", encoding="utf-8") if log is not None else None  # noqa: SIM115 - open for the stream's life, closed in close()

    def write(self, text: str) -> int:
        with self._logged:
            self.parts.append(text)
            if self._log is not None:
                self._log.write(text)
            *lines, self._partial = (self._partial + text).split("\n")
            self.steps += [int(found["step"]) for found in map(STEP_LINE.match, lines) if found]
            self._logged.notify_all()
        return len(text)

    def flush(self) -> None:
        if self._log is not None:
            self._log.flush()

    def close(self) -> None:
        super().close()
        if self._log is not None:
            self._log.close()

    @property
    def text(self) -> str:
        """Everything written so far.

        :rtype: str
        """
        return "".join(self.parts)

    def wait_for_step(self, step: int, timeout: float = WAIT_S) -> None:
        """Block until step ``step`` (or a later one) is logged.

        :raises TimeoutError: after ``timeout`` seconds.
        """
        with self._logged:
            if not self._logged.wait_for(lambda: any(seen >= step for seen in self.steps), timeout):
                raise TimeoutError(f"step {step} was not logged within {timeout:.0f} s")


def rank_process(tag: str, rank: int = KILLED_RANK) -> psutil.Process:
    """The training process of ``rank`` on this machine (where `local` pods run), found by its ``RANK``
    and ``TAG_VAR=tag`` in its environment; DeepSpeed's per-host launch.py, its parent, has no ``RANK``.

    :raises LookupError: when there is none.
    :rtype: psutil.Process
    """
    for process in psutil.process_iter():
        try:
            environment = process.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if environment.get(TAG_VAR) == tag and environment.get("RANK") == str(rank):
            return process
    raise LookupError(f"no training process of rank {rank} with {TAG_VAR}={tag}")


def sigkill_rank(tag: str, rank: int = KILLED_RANK) -> float:
    """SIGKILL the training process of ``rank`` (see :func:`rank_process`); the time of the kill.

    :rtype: float
    """
    process = rank_process(tag, rank)
    killed_at = time.time()
    process.kill()
    return killed_at


def kill_pod(tag: str, rank: int = KILLED_RANK) -> float:
    """SIGKILL the whole `local` pod that runs ``rank``, as a deleted pod or a lost VM goes: its agent
    and everything under it (sshd, DeepSpeed's launch.py, the ranks) at once; the time of the kill.

    :raises LookupError: when the rank runs under no agent.
    :rtype: float
    """
    agent = next((p for p in rank_process(tag, rank).parents() if "worker.agent" in p.cmdline()), None)
    if agent is None:
        raise LookupError(f"rank {rank} of {tag} runs under no worker agent")
    processes = [agent, *agent.children(recursive=True)]
    killed_at = time.time()
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return killed_at


def supervised_arguments(data: Path, output: Path, tag: str, **values) -> LaunchArguments:
    """The launch of a short real training run tagged ``tag``, every step logged, no evaluation.

    :param values: training arguments on top (``max_steps``, ``save_steps``, ``profile`` ...).
    :rtype: LaunchArguments
    """
    args = train_argv(
        model=DEFAULT_MODEL_DIR,
        data_dir=data,
        logging_steps=1,
        eval_strategy="no",
        disable_tqdm=True,
        log_level="info",
        **{"profile": PROFILE} | values,
    )
    return LaunchArguments(run_dir=output, train_args=args, env={TAG_VAR: tag})


def kill_after(
    stream: StepStream, step: int, checkpoint: Path, tag: str, killed: dict, kill: Callable[[str], float] = sigkill_rank
) -> threading.Thread:
    """A started thread that kills rank 1 (``kill``: its process, or :func:`kill_pod`) once ``step`` is
    logged, after checking ``checkpoint`` is complete; ``killed`` gets ``at`` (the kill's time) or ``error``.

    :rtype: threading.Thread
    """

    def kill_at_step() -> None:
        try:
            stream.wait_for_step(step)
            if not (checkpoint / COMPLETE_MARKER).is_file():
                raise RuntimeError(f"step {step} logged but {checkpoint.name} is not complete")
            killed["at"] = kill(tag)
        except Exception as error:  # noqa: BLE001 - reported by the caller, which is in another thread
            killed["error"] = repr(error)

    thread = threading.Thread(target=kill_at_step, name="kill-rank", daemon=True)
    thread.start()
    return thread


def once(
    cluster,
    data: Path,
    work: Path,
    sizes: Sizes,
    kill: Callable[[str], float] = sigkill_rank,
    min_workers: int | None = None,
) -> dict:
    """One supervised run with one kill (``kill``: rank 1's process, or its whole pod); its detection time,
    downtime, repeated steps and, when the run went on with fewer workers, the checkpoint's conversion time.

    :rtype: dict
    """
    output, tag, killed = work / "out", uuid.uuid4().hex, {}
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    stream = StepStream(work / "bench.log")
    checkpoint = output / f"checkpoint-{sizes.kill_after_step // sizes.save_steps * sizes.save_steps}"
    killer = kill_after(stream, sizes.kill_after_step, checkpoint, tag, killed, kill=kill)
    arguments = supervised_arguments(
        data,
        output,
        tag,
        max_steps=sizes.steps,
        save_steps=sizes.save_steps,
        per_device_train_batch_size=sizes.batch_size,
    )
    try:
        code = supervise(arguments, cluster, max_restarts=1, stream=stream, min_workers=min_workers)
    finally:
        stream.close()
    killer.join(timeout=1)
    if code != 0 or "at" not in killed:
        raise RuntimeError(f"recovery run failed (exit code {code}, kill {killed}); see {work / 'bench.log'}")
    return figures(read_json(output / SUPERVISOR_FILE)["events"], killed["at"])


def figures(events: list[dict], killed_at: float) -> dict:
    """Detection time, downtime and repeated steps from the supervisor's events and the kill's time.

    :raises RuntimeError: when the events do not show one lost worker and a resumed run.
    :rtype: dict
    """
    lost = next((event for event in events if event["event"] == FailureKind.WORKER_LOST), None)
    resumed = next((event for event in events if event["event"] == "resumed"), None)
    if lost is None or resumed is None or not resumed.get("checkpoint"):
        raise RuntimeError(
            f"the supervisor recorded no lost worker and resume from a checkpoint: {[e['event'] for e in events]}"
        )
    resumed_step = int(Path(resumed["checkpoint"]).name.rsplit("-", 1)[1])
    shrunk = next((event for event in events if event["event"] == "shrunk"), {})
    return {
        "detection_s": lost["aware_at"] - killed_at,
        "downtime_s": resumed["first_step_at"] - killed_at,
        "repeated_steps": lost["step"] - resumed_step,
        "conversion_s": shrunk.get("converted_s"),
    }


def run(data_dir: str, work: Path, sizes: Sizes = Sizes()) -> dict:
    """``repetitions`` supervised runs on two fresh `local` pods; medians of the figures.

    :rtype: dict
    """
    from worker.cluster import start_workers

    data = train_only(data_dir, work)
    runs = []
    with start_workers("local", 2, work / "recovery-run", timeout=120) as cluster:
        for index in range(sizes.repetitions):
            runs.append(once(cluster, data, work / f"recovery-{index}", sizes))
            logger.info("recovery %d: %s", index, runs[-1])
    detection, downtime = [r["detection_s"] for r in runs], [r["downtime_s"] for r in runs]
    return {
        "value": round(statistics.median(downtime), 1),
        "unit": "s",
        "goal": None,
        "detection_s": summary(detection, 2),
        "downtime_s": summary(downtime, 1),
        "repeated_steps": [r["repeated_steps"] for r in runs],
        "method": (
            f"two `local` worker pods, embedded small T5, profile {PROFILE}, batch {sizes.batch_size} per rank, "
            f"{sizes.steps} steps, checkpoint every {sizes.save_steps}; rank 1 SIGKILLed once step {sizes.kill_after_step} "
            "was logged; value: downtime, kill to the relaunched run's first logged step; detection: kill to the "
            f"supervisor's first sign of the failure; DeepSpeed ops already cached; {sizes.repetitions} run(s), median"
        ),
    }


def run_shrink(data_dir: str, work: Path, sizes: Sizes = Sizes()) -> dict:
    """``repetitions`` supervised runs, each on three fresh `local` pods with no capacity for a replacement and
    ``min_workers`` 2: the whole pod of rank 1 is killed, the run goes on with two; medians of the figures.

    :rtype: dict
    """
    from worker.cluster import start_workers

    data = train_only(data_dir, work)
    runs = []
    for index in range(sizes.repetitions):
        with start_workers("local", 3, work / f"shrink-run-{index}", timeout=120, replacements=False) as cluster:
            runs.append(once(cluster, data, work / f"shrink-{index}", sizes, kill=kill_pod, min_workers=2))
        logger.info("shrink %d: %s", index, runs[-1])
    downtime, conversion = [r["downtime_s"] for r in runs], [r["conversion_s"] for r in runs]
    return {
        "value": round(statistics.median(downtime), 1),
        "unit": "s",
        "goal": None,
        "downtime_s": summary(downtime, 1),
        "conversion_s": summary(conversion, 1),
        "detection_s": summary([r["detection_s"] for r in runs], 2),
        "repeated_steps": [r["repeated_steps"] for r in runs],
        "method": (
            f"three `local` worker pods, replacements impossible, min_workers 2; embedded small T5, profile {PROFILE}, "
            f"batch {sizes.batch_size} per rank, {sizes.steps} steps, checkpoint every {sizes.save_steps}; the whole pod "
            f"of rank 1 SIGKILLed once step {sizes.kill_after_step} was logged; value: downtime, kill to the first step "
            "logged on the two workers left (the replacement's refusal, the checkpoint's conversion for two ranks and "
            "the relaunch); conversion: ds_to_universal in its own process, imports included; DeepSpeed ops already "
            f"cached; {sizes.repetitions} run(s), median"
        ),
    }
