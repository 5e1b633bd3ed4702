"""EMULATOR of Cloudera Machine Learning's ``cml.workers_v1``, for tests on a machine without CML.

The real module exists only inside a CML session, where each worker is a separate engine (pod).
Here each "engine" is a local process running the given ``code`` (or ``script``) with its image's variables
(``fakes.image_env``: never the launching session's own environment, which a CML engine does not inherit), the
given ``env``, and the variables CML sets in an engine: ``CDSW_ENGINE_ID`` and ``CDSW_IP_ADDRESS`` (a loopback
address per engine: 127.0.0.2, 127.0.0.3, ...). A real CML also gives every engine the project's environment
variables; the emulated project has none. Signatures follow the documented API
of releases without ``name=``: launch_workers(n, cpu, memory, nvidia_gpu=0, kernel="python3",
script="", code="", env={}, accelerator_label_id=None, resource_profile_id=None, resource_group_id=None),
await_workers(ids, wait_for_completion=True, timeout_seconds=60), list_workers(), stop_workers(*worker_id).
cpu, memory, nvidia_gpu and the placement ids are accepted and ignored (the placement ids recorded in ``launches``).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time

from fakes.image_env import image_environment

_engines: dict[str, dict] = {}
# What each launch_workers call asked for beyond the engines themselves, for tests to read.
launches: list[dict] = []
_counter = itertools.count()


def _status(engine: dict) -> str:
    code = engine["process"].poll()
    if engine["stopped"]:
        return "stopped"
    if code is None:
        return "running"
    return "succeeded" if code == 0 else "failed"


def _describe(engine_id: str) -> dict:
    engine = _engines[engine_id]
    return {"id": engine_id, "status": _status(engine), "ip_address": engine["ip"], "name": engine_id}


def _signal_engine(engine: dict, signum: int) -> None:
    # Stopping an engine ends its pod: every process in it, not only the first (its session's group here).
    try:
        os.killpg(engine["process"].pid, signum)
    except ProcessLookupError:
        pass


def launch_workers(
    n,
    cpu,
    memory,
    nvidia_gpu=0,
    kernel="python3",
    script="",
    code="",
    env={},  # noqa: B006 - CML's own signature, never mutated
    accelerator_label_id=None,
    resource_profile_id=None,
    resource_group_id=None,
):
    launches.append(
        {
            "n": n,
            "accelerator_label_id": accelerator_label_id,
            "resource_profile_id": resource_profile_id,
            "resource_group_id": resource_group_id,
        }
    )
    launched = []
    for _ in range(n):
        index = next(_counter)
        engine_id = f"emu{os.getpid()}x{index}"
        ip = f"127.0.0.{2 + index % 250}"
        command = [sys.executable, script] if script else [sys.executable, "-c", code]
        process = subprocess.Popen(
            command,
            env={**image_environment(), **env, "CDSW_ENGINE_ID": engine_id, "CDSW_IP_ADDRESS": ip},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _engines[engine_id] = {"process": process, "ip": ip, "stopped": False}
        launched.append(_describe(engine_id))
    return launched


def await_workers(ids, wait_for_completion=True, timeout_seconds=60):
    deadline = time.monotonic() + timeout_seconds
    wanted = [str(i.get("id") if isinstance(i, dict) else i) for i in ids]
    while True:
        states = {engine_id: _status(_engines[engine_id]) for engine_id in wanted}
        done = [i for i, s in states.items() if s != "running"] if wait_for_completion else list(states)
        if len(done) == len(wanted) or time.monotonic() >= deadline:
            failed = [
                i for i, s in states.items() if s in ("failed", "stopped") or (wait_for_completion and s == "running")
            ]
            return {
                "workers": [_describe(i) for i in wanted if i not in failed],
                "failures": [_describe(i) for i in failed],
            }
        time.sleep(0.1)


def list_workers():
    return [_describe(engine_id) for engine_id in _engines]


def stop_workers(*worker_id):
    targets = [str(i) for i in worker_id] or list(_engines)
    for engine_id in targets:
        engine = _engines[engine_id]
        if engine["process"].poll() is None:
            _signal_engine(engine, signal.SIGTERM)
            try:
                engine["process"].wait(timeout=10)
            except subprocess.TimeoutExpired:
                _signal_engine(engine, signal.SIGKILL)
                engine["process"].wait()
        engine["stopped"] = True
    return [_describe(engine_id) for engine_id in targets]
