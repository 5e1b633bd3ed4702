"""Run one notebook headless with papermill, as ``textsql demo`` and a CML job do, recorded in the run's
``pipeline.json`` so a failed chain can continue, and say first what the runtime lacks for the notebooks' parameters.

The kernel runs in ``notebooks/`` (as in JupyterLab); a failing cell ends the run with one line naming the
cell's error and the executed copy to open.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from contextlib import chdir
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textsql.json_files import read_json
from textsql.pipeline.leftovers import end_leftovers
from textsql.pipeline.manifest import Manifest, Step, continuation_steps, effective_parameters, manifest_path
from textsql.pipeline.parameters import NOTEBOOKS_DIR, NotebookError, check_parameters, notebook_path
from worker.files import atomic_write

if TYPE_CHECKING:
    from textsql.launching.preflight import Check

logger = logging.getLogger(__name__)

KERNEL_NAME = "python3"
# The kernel's own log is no concern of a user's: a start-up warning (TCP on loopback, which papermill
# chose), and an ERROR line when the interrupt jupyter_client sends at every shutdown lands while the kernel
# is still handling a message (a race, seen under load). A cell's error reaches the user through papermill.
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL"]


def run_notebook(
    name: str,
    output: str | Path,
    parameters: Mapping[str, Any] | None = None,
    log_output: bool = True,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Execute one notebook with papermill and write the executed copy to ``output``.

    The kernel runs in ``notebooks/`` (as in JupyterLab), with this Python's ``python3`` kernel.

    Usage::

        >>> run_notebook("01_prepare_dataset", "runs/x/01_prepare_dataset.ipynb", {"data_dir": "/abs/runs/x/data"})

    :param name: the notebook.
    :param output: path of the executed notebook.
    :param parameters: values for the notebook's ``parameters`` cell.
    :param log_output: stream the cells' output to this process's log as they run.
    :param env: variables the kernel gets beside this process's environment (and passes to what it starts).
    :rtype: pathlib.Path
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError
    from traitlets.config import Config

    check_parameters(name, parameters or {})
    write_notebooks_without_following_links()
    output = Path(output).absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    logger.debug("running %s -> %s with %s", name, output, dict(parameters or {}))
    try:
        papermill.execute_notebook(
            str(notebook_path(name)),
            str(output),
            parameters=dict(parameters or {}),
            kernel_name=KERNEL_NAME,
            cwd=str(NOTEBOOKS_DIR),
            log_output=log_output,
            progress_bar=False,
            extra_arguments=KERNEL_ARGUMENTS,
            kernel_manager_class=kernel_with_variables(),
            config=Config({"KernelWithVariables": {"variables": dict(env or {})}}),
        )
    except PapermillExecutionError as error:
        raise NotebookError(
            f"notebook {name} failed in cell {error.exec_count}: {error.ename}: {error.evalue}; open {output}"
        ) from None
    return output


@functools.cache  # one class: papermill (an extra) and jupyter_client are imported only when a notebook runs
def kernel_with_variables() -> type:
    """jupyter_client's kernel manager whose kernel gets its ``variables`` beside this process's environment: a
    notebook's kernel carries its attempt's marks, and this process's environment is left as it is.

    :rtype: type
    """
    from jupyter_client import AsyncKernelManager
    from traitlets import Dict

    class KernelWithVariables(AsyncKernelManager):
        variables = Dict(config=True, help="Variables the kernel gets beside this process's environment.")

        # AsyncKernelManager's start_kernel is a coroutine; jupyter_client declares it with the blocking one's type.
        async def start_kernel(self, **kw: Any) -> None:  # type: ignore[override]
            kw["env"] = {**kw.get("env", os.environ), **self.variables}
            await super().start_kernel(**kw)

    return KernelWithVariables


@functools.cache  # registered once a process
def write_notebooks_without_following_links() -> None:
    """Make papermill write local notebooks as a new file renamed into place (:func:`worker.files.atomic_write`).

    The executed copies lie in the run directory the pods share, and papermill's own local handler opens the path
    for writing at the start and every 30 s: a link a worker planted there would have the master overwrite the file
    it points to.
    """
    from papermill.iorw import LocalHandler, papermill_io

    class NoFollowHandler(LocalHandler):
        def write(self, buf: str, path: str) -> None:
            with chdir(self._cwd or "."):
                atomic_write(Path(path), buf)

    # For every absolute path (run_notebook passes only those): papermill keeps its oldest "local" handler as the
    # fallback, so a newer one registered under that name would never be asked.
    papermill_io.register("/", NoFollowHandler())


def continuation_plan(run_dir: Path, chosen: Mapping[str, Mapping[str, Any]]) -> tuple[Manifest, dict[str, Step]]:
    """Read the chain's record in ``run_dir``, end what a hard kill of the earlier attempt left running here
    (:func:`textsql.pipeline.leftovers.end_leftovers`), then decide what continuing it runs
    (:func:`textsql.pipeline.manifest.continuation_steps`): in that order, since the killed attempt's ranks may
    write a newer checkpoint until they are ended.

    :param run_dir: the chain's run directory.
    :param chosen: every notebook's parameters now.
    :rtype: tuple[Manifest, dict[str, Step]]
    :raises NotebookError: while the earlier attempt still runs, or for a change a checkpoint cannot take.
    """
    manifest = Manifest.load(run_dir)
    refuse_while_running(manifest)
    end_leftovers(run_dir, manifest.attempt.get("id"))
    return manifest, continuation_steps(manifest, chosen)


def end_earlier_attempt(run_dir: Path) -> None:
    """Before a new chain replaces ``run_dir``: refuse while the chain recorded there still runs, else end what a
    hard kill of it left running here (:func:`textsql.pipeline.leftovers.end_leftovers`), whose ranks would otherwise
    go on writing into the new run. The record's version is not checked: it is about to be replaced.

    :param run_dir: the chain's run directory.
    :raises NotebookError: while the earlier attempt still runs, naming its pid.
    """
    path = manifest_path(run_dir)
    manifest = Manifest(run_dir, read_json(path) if path.is_file() else None)
    refuse_while_running(manifest)
    end_leftovers(run_dir, manifest.attempt.get("id"))


def refuse_while_running(manifest: Manifest) -> None:
    """Refuse to continue or replace a chain whose earlier attempt still runs (:meth:`Manifest.running_elsewhere`).

    :raises NotebookError: naming its pid and how to stop it.
    """
    pid = manifest.running_elsewhere()
    if pid is not None:
        raise NotebookError(
            f"the notebooks are still running in {manifest.run_dir} (pid {pid}); let them finish, "
            f"or stop them (kill {pid}) first"
        )


def run_recorded(
    manifest: Manifest, name: str, output: Path, parameters: Mapping[str, Any], step: Step | None = None
) -> Path:
    """:func:`run_notebook` with its start and end recorded in ``manifest`` (completed, or failed on an error or
    interrupt; a hard kill leaves it running, which a continuation reads as not completed).

    :param manifest: the chain's record (its attempt begun: :meth:`Manifest.begin`; the kernel carries its
        :meth:`~Manifest.marks`).
    :param name: the notebook.
    :param output: path of the executed notebook.
    :param parameters: values for its ``parameters`` cell.
    :param step: what the continuation plan says (its parameters are added), or None for a plain run.
    :rtype: pathlib.Path
    """
    parameters = {**parameters, **(step.extra if step else {})}
    check_parameters(name, parameters)
    manifest.started(name, effective_parameters(name, parameters), output)
    completed = False
    try:
        run_notebook(name, output, parameters, env=manifest.marks())
        completed = True
    finally:
        manifest.finished(name, completed)
    return output


def runtime_checks(chosen: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """What this runtime has and lacks for notebooks 01 and 02 with these parameters
    (:func:`textsql.launching.preflight.check_runtime`).

    :param chosen: every notebook's parameters (:func:`job_parameters`).
    :rtype: list[textsql.launching.preflight.Check]
    """
    from textsql.launching.preflight import check_runtime

    prepare, train = chosen["01_prepare_dataset"], chosen["02_train_distributed"]
    return check_runtime(
        model=prepare["model"],
        source=prepare["source"],
        backend=train["backend"],
        worker_gpus=train["worker_gpus"],
        training_model=train["model"],
    )
