"""``cml``: worker engines through Cloudera Machine Learning's workers API (``cml.workers_v1``).

Each engine runs ``python -m worker.agent``; it finds its address in ``CDSW_IP_ADDRESS`` and reports
``CDSW_ENGINE_ID`` as its pod name, which is the id ``launch_workers`` returned, so a missing
engine is named by id. A lost engine is replaced by launching one more with the same options
(named ``textsql-worker-rK`` where the release accepts ``name=``) and stopping the lost one if CML
still lists it running. The token travels as a path on the project filesystem that CML mounts in
every engine, never as a value. ``cml.workers_v1`` exists only inside CML (older CDSW: ``cdsw``);
the tests run an emulator with the same signatures (tests/fakes/cml/workers_v1.py).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from types import ModuleType
from typing import Any

from worker.backends.base import Backend, Resources, WorkerHandle
from worker.errors import WorkerError

logger = logging.getLogger(__name__)

# A child process, not the engine's own interpreter: the agent owns its signals and exit code.
AGENT_CODE = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', 'worker.agent']))"
_ENDED = {"succeeded", "failed", "stopped", "timedout"}


def import_workers_api() -> ModuleType:
    """``cml.workers_v1`` (CML), else ``cdsw`` (older CDSW releases).

    :rtype: types.ModuleType
    """
    for name in ("cml.workers_v1", "cdsw"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise WorkerError("cml.workers_v1 is only available inside a CML session; use backend='local' on this machine")


class CMLBackend(Backend):
    """Worker engines launched from a CML session."""

    name = "cml"

    def __init__(self, api: ModuleType | None = None, script: str | None = None, name: str = "textsql-worker") -> None:
        """
        :param api: the workers module (default: :func:`import_workers_api`).
        :param script: a project script for engines to run instead of the agent code.
        :param name: engine name, where the CML release accepts ``name=``.
        """
        self.api = api or import_workers_api()
        self.script = script
        self.engine_name = name
        self._ids: list[str] = []
        # launch_workers' options from launch(), so a replacement engine starts as the others did.
        self._options: dict[str, Any] = {}
        self._replaced = 0

    def advertised_address(self) -> str:
        address = os.environ.get("CDSW_IP_ADDRESS")
        if not address:
            raise WorkerError("CDSW_IP_ADDRESS is not set; run inside a CML session or pass master_address=")
        return address

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(engine_id) for engine_id in self._ids]

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        self._options = {"cpu": resources.cpu, "memory": resources.memory_gb, "nvidia_gpu": resources.gpus, "env": env}
        if self.script:
            self._options["script"] = self.script
        else:
            self._options["code"] = AGENT_CODE
        ids = self._launch(count, self.engine_name)
        logger.info("launched %d CML workers: %s", len(ids), " ".join(ids))
        if len(ids) < count:
            raise WorkerError(f"CML launched {len(ids)} of {count} workers; check the project's quota")
        return [WorkerHandle(engine_id) for engine_id in ids]

    def _launch(self, count: int, name: str) -> list[str]:
        options = dict(self._options, n=count)
        if "name" in inspect.signature(self.api.launch_workers).parameters:  # older releases lack name=
            options["name"] = name
        ids = [str(worker["id"]) for worker in self.api.launch_workers(**options)]
        self._ids += ids
        return ids

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Stop engine ``pod`` if CML still lists it running, and launch one new engine like it.

        CML gives the new engine its own id and IP, so the replacement registers at a new address with
        a new host key; its name (where the release accepts ``name=``) ends in ``-rK``.

        :param pod: the lost engine's id.
        :param timeout: unused: launch_workers returns at once; the caller waits for the engine to
            run (``await_workers``) and register.
        :rtype: WorkerHandle
        :raises WorkerError: if ``pod`` is not one of this backend's engines, or CML launched none.
        """
        if pod not in self._ids:
            raise WorkerError(
                f"no CML worker {pod!r} of this run to replace; workers: {', '.join(self._ids) or 'none'}"
            )
        self._ids.remove(pod)
        status = next((w.get("status") for w in self.api.list_workers() if str(w.get("id")) == pod), None)
        if status is not None and status not in _ENDED:
            self.api.stop_workers(pod)  # still listed (cut off, not ended): it must not hold its resources
        self._replaced += 1
        ids = self._launch(1, f"{self.engine_name}-r{self._replaced}")
        if not ids:
            raise WorkerError(f"CML launched no replacement for worker {pod}; check the project's quota")
        logger.info("replaced CML worker %s (%s) with %s", pod, status or "no longer listed", ids[0])
        return WorkerHandle(ids[0], f"replaces {pod}")

    def wait(self, timeout: float) -> None:
        result = self.api.await_workers(self._ids, wait_for_completion=False, timeout_seconds=max(1, int(timeout)))
        failures = result.get("failures") or []
        if failures:
            described = ", ".join(f"{w.get('id')} ({w.get('status', 'failed')})" for w in failures)
            raise WorkerError(f"CML workers did not start: {described}; see their logs in the session's Workers tab")

    def failures(self) -> dict[str, str]:
        ours = set(self._ids)
        return {
            str(w["id"]): f"ended with status {w.get('status')!r} before registering"
            for w in self.api.list_workers()
            if str(w.get("id")) in ours and w.get("status") in _ENDED
        }

    def stop(self) -> None:
        if self._ids:
            self.api.stop_workers(*self._ids)
            logger.info("stopped %d CML workers", len(self._ids))
        self._ids = []
