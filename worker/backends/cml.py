"""``cml``: worker engines through Cloudera Machine Learning's workers API (``cml.workers_v1``).

Each engine runs ``python -m worker.agent``; it finds its address in ``CDSW_IP_ADDRESS`` and reports
``CDSW_ENGINE_ID`` as its pod name, which is the id ``launch_workers`` returned, so a missing
engine is named by id. The token travels as a path on the project filesystem that CML mounts in
every engine, never as a value. ``cml.workers_v1`` exists only inside CML (older CDSW: ``cdsw``);
the tests run an emulator with the same signatures (tests/fakes/cml/workers_v1.py).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
from types import ModuleType

from worker.errors import WorkerError
from worker.backends.base import Backend, Resources, WorkerHandle

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

    def advertised_address(self) -> str:
        address = os.environ.get("CDSW_IP_ADDRESS")
        if not address:
            raise WorkerError("CDSW_IP_ADDRESS is not set; run inside a CML session or pass master_address=")
        return address

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(engine_id) for engine_id in self._ids]

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        options = dict(n=count, cpu=resources.cpu, memory=resources.memory_gb, nvidia_gpu=resources.gpus, env=env)
        if self.script:
            options["script"] = self.script
        else:
            options["code"] = AGENT_CODE
        if "name" in inspect.signature(self.api.launch_workers).parameters:  # older releases lack name=
            options["name"] = self.engine_name
        launched = self.api.launch_workers(**options)
        ids = [str(worker["id"]) for worker in launched]
        self._ids += ids
        logger.info("launched %d CML workers: %s", len(ids), " ".join(ids))
        if len(ids) < count:
            raise WorkerError(f"CML launched {len(ids)} of {count} workers; check the project's quota")
        return [WorkerHandle(engine_id) for engine_id in ids]

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
            for w in self.api.list_workers() if str(w.get("id")) in ours and w.get("status") in _ENDED
        }

    def stop(self) -> None:
        if self._ids:
            self.api.stop_workers(*self._ids)
            logger.info("stopped %d CML workers", len(self._ids))
        self._ids = []
