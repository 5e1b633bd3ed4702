"""``cml``: worker engines through Cloudera Machine Learning's workers API (``cml.workers_v1``).

Each engine runs ``python -m worker.agent``; it finds its address in ``CDSW_IP_ADDRESS`` and reports
the name this backend gave it (``textsql-worker-N``, in its ``env``, beside the engine id CML returned).
Engines are launched one at a time, so each ``env`` holds only that engine's own rendezvous key (the
run token stays with the master). A lost engine is replaced by launching one more with the same options
(``textsql-worker-N-rK``) and stopping the lost one if CML still lists it running. ``cml.workers_v1`` exists only inside CML (older CDSW: ``cdsw``);
the tests run an emulator with the same signatures (tests/fakes/cml/workers_v1.py).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from worker import constants as c
from worker.backends.base import Backend, Resources, WorkerHandle
from worker.errors import WorkerError
from worker.rendezvous.token import pod_key, read_token

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
    """Worker engines launched from a CML session, one ``launch_workers`` call each: each engine's ``env``
    carries its own name (``TEXTSQL_WORKER_POD``) and only its own rendezvous key."""

    name = "cml"
    shares_run_dir = True  # every engine mounts the project

    def __init__(
        self,
        api: ModuleType | None = None,
        script: str | None = None,
        name: str = "textsql-worker",
        accelerator_label_id: int | None = None,
        resource_profile_id: int | None = None,
        resource_group_id: int | None = None,
    ) -> None:
        """
        :param api: the workers module (default: :func:`import_workers_api`).
        :param script: a project script for engines to run instead of the agent code.
        :param name: prefix of the workers' names (``NAME-0``, ``NAME-1``, a replacement ``NAME-1-r1``).
        :param accelerator_label_id: the GPU type (from the workspace's accelerator labels), where a project has
            several; passed on only when given.
        :param resource_profile_id: a resource profile of the workspace instead of cpu/memory; only when given.
        :param resource_group_id: the resource group (node pool) to run in; only when given.
        """
        self.api = api or import_workers_api()
        self.script = script
        self.engine_name = name
        # Worker name -> CML engine id, in launch order.
        self._engines: dict[str, str] = {}
        self.placement = {
            key: value
            for key, value in (
                ("accelerator_label_id", accelerator_label_id),
                ("resource_profile_id", resource_profile_id),
                ("resource_group_id", resource_group_id),
            )
            if value is not None
        }
        # launch_workers' options from launch(), so a replacement engine starts as the others did.
        self._options: dict[str, Any] = {}
        self._launched = 0
        self._replaced = 0

    def advertised_address(self) -> str:
        address = os.environ.get("CDSW_IP_ADDRESS")
        if not address:
            raise WorkerError("CDSW_IP_ADDRESS is not set; run inside a CML session or pass master_address=")
        return address

    @property
    def pods(self) -> list[WorkerHandle]:
        return [WorkerHandle(pod, f"engine {engine_id}") for pod, engine_id in self._engines.items()]

    def launch(self, count: int, resources: Resources, env: dict[str, str]) -> list[WorkerHandle]:
        if self.pod_key is None:  # called with the run's token rather than by start_workers
            self.pod_key = partial(pod_key, env.get(c.ENV_TOKEN) or read_token(Path(env[c.ENV_TOKEN_FILE])))
        shared = {key: value for key, value in env.items() if key not in (c.ENV_TOKEN, c.ENV_TOKEN_FILE)}
        accepted = inspect.signature(self.api.launch_workers).parameters
        unknown = sorted(set(self.placement) - set(accepted))
        if unknown:
            raise WorkerError(
                f"this CML release's launch_workers takes no {', '.join(unknown)}; leave it out of backend_options"
            )
        self._options = dict(
            cpu=resources.cpu, memory=resources.memory_gb, nvidia_gpu=resources.gpus, env=shared, **self.placement
        )
        if self.script:
            self._options["script"] = self.script
        else:
            self._options["code"] = AGENT_CODE
        handles: list[WorkerHandle] = []
        for _ in range(count):
            handle = self._launch(f"{self.engine_name}-{self._launched}")
            self._launched += 1
            if handle is None:
                raise WorkerError(f"CML launched {len(handles)} of {count} workers; check the project's quota")
            handles.append(handle)
        logger.info("launched %d CML workers: %s", len(handles), " ".join(h.detail for h in handles))
        return handles

    def _launch(self, pod: str) -> WorkerHandle | None:
        assert self.pod_key is not None, "launch() sets pod_key before any engine starts"
        env = {**self._options["env"], c.ENV_POD: pod, c.ENV_TOKEN: self.pod_key(pod)}
        options = dict(self._options, n=1, env=env)
        if "name" in inspect.signature(self.api.launch_workers).parameters:  # older releases lack name=
            options["name"] = pod
        engines = self.api.launch_workers(**options)
        if not engines:
            return None
        self._engines[pod] = str(engines[0]["id"])
        return WorkerHandle(pod, f"engine {self._engines[pod]}")

    def replace(self, pod: str, timeout: float) -> WorkerHandle:
        """Stop ``pod``'s engine if CML still lists it running, and launch one new engine like it.

        CML gives the new engine its own id and IP, so the replacement registers at a new address with
        a new host key, under the name ``POD-rK`` with its own key.

        :param pod: the lost worker's name.
        :param timeout: unused: launch_workers returns at once; the caller waits for the engine to
            run (``await_workers``) and register.
        :rtype: WorkerHandle
        :raises WorkerError: if ``pod`` is not one of this backend's workers, or CML launched none.
        """
        if pod not in self._engines:
            raise WorkerError(
                f"no CML worker {pod!r} of this run to replace; workers: {', '.join(self._engines) or 'none'}"
            )
        engine_id = self._engines.pop(pod)
        status = next((w.get("status") for w in self.api.list_workers() if str(w.get("id")) == engine_id), None)
        if status is not None and status not in _ENDED:
            self.api.stop_workers(engine_id)  # still listed (cut off, not ended): it must not hold its resources
        self._replaced += 1
        handle = self._launch(f"{re.sub(r'-r[0-9]+$', '', pod)}-r{self._replaced}")
        if handle is None:
            raise WorkerError(f"CML launched no replacement for worker {pod}; check the project's quota")
        logger.info(
            "replaced CML worker %s (%s) with %s (%s)", pod, status or "no longer listed", handle.pod, handle.detail
        )
        return WorkerHandle(handle.pod, f"{handle.detail}, replaces {pod}")

    def wait(self, timeout: float) -> None:
        engines = list(self._engines.values())
        result = self.api.await_workers(engines, wait_for_completion=False, timeout_seconds=max(1, int(timeout)))
        failures = result.get("failures") or []
        if failures:
            names = {engine_id: pod for pod, engine_id in self._engines.items()}
            described = ", ".join(
                f"{names.get(str(w.get('id')), w.get('id'))} ({w.get('status', 'failed')})" for w in failures
            )
            raise WorkerError(f"CML workers did not start: {described}; see their logs in the session's Workers tab")

    def failures(self) -> dict[str, str]:
        names = {engine_id: pod for pod, engine_id in self._engines.items()}
        return {
            names[str(w["id"])]: f"ended with status {w.get('status')!r} before registering (engine {w['id']})"
            for w in self.api.list_workers()
            if str(w.get("id")) in names and w.get("status") in _ENDED
        }

    def stop(self) -> None:
        if self._engines:
            self.api.stop_workers(*self._engines.values())
            logger.info("stopped %d CML workers", len(self._engines))
        self._engines = {}
