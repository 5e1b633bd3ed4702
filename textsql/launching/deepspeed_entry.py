"""DeepSpeed's own launcher programs, run as ``python -m`` runs them but without MLflow.

``python -m textsql.launching.deepspeed_entry deepspeed.launcher.runner ARGS`` is the ``deepspeed ARGS`` command
(:func:`textsql.launching.command.deepspeed_command`), and ``... deepspeed.launcher.launch ARGS`` the per-node
launcher of a local launch (:func:`textsql.launching.command.local_command`). Either imports all of DeepSpeed, and
with it the MLflow its autotuner imports (:mod:`textsql.tracking.mlflow_free`): 1.45 of the runner's 3.0 CPU
seconds before it starts pdsh, on 2 cores. Neither program tracks or autotunes; their code runs unchanged. The
runner's pdsh command line starts each host's per-node launcher through this entry as well (the ranks'
``PYTHONPATH`` holds this package there), and the ``pkill -f`` pattern its interrupt handler would run matches that
line, as DeepSpeed's matches its own.
"""

from __future__ import annotations

import runpy
import sys

from textsql.tracking.mlflow_free import import_deepspeed_lean

ENTRY_MODULE = "textsql.launching.deepspeed_entry"
RUNNER = "deepspeed.launcher.runner"
NODE_LAUNCHER = "deepspeed.launcher.launch"
PROGRAMS = (RUNNER, NODE_LAUNCHER)


def main(argv: list[str] | None = None) -> None:
    """Run the DeepSpeed program ``argv[0]`` names with the arguments after it (``sys.argv[1:]`` when ``None``).

    :param argv: the program's module, then its arguments.
    """
    words = sys.argv[1:] if argv is None else argv
    if not words or words[0] not in PROGRAMS:
        sys.exit(f"usage: python -m {ENTRY_MODULE} {{{','.join(PROGRAMS)}}} ARGS")
    program, *arguments = words
    import_deepspeed_lean()
    if program == RUNNER:
        _node_launchers_through_entry()
    # As `python -m PROGRAM ARGS`: sys.argv[0] becomes the program's file, and its arguments follow.
    sys.argv[1:] = arguments
    runpy.run_module(program, run_name="__main__", alter_sys=True)


def through_entry(pdsh_command: list[str], kill_command: list[str]) -> tuple[list[str], list[str]]:
    """DeepSpeed's pdsh command and its kill command with each host's per-node launcher started by this entry.

    :param pdsh_command: ``PDSHRunner.get_cmd``'s command: ``pdsh ... PYTHON -u -m deepspeed.launcher.launch ...``.
    :param kill_command: its kill command, whose last word is the ``pkill -f`` pattern of that launcher's line.
    :rtype: tuple[list[str], list[str]]
    """
    at = pdsh_command.index(NODE_LAUNCHER)
    # The pattern is the launcher's words joined by escaped spaces (`PYTHON\ -u\ -m\ deepspeed.launcher.launc`).
    launcher_words = "-m\\ deepspeed.launcher."
    if pdsh_command[at - 1] != "-m" or launcher_words not in kill_command[-1]:
        raise ValueError(f"DeepSpeed's pdsh command no longer runs `-m {NODE_LAUNCHER}`: {pdsh_command}")
    pattern = kill_command[-1].replace(launcher_words, f"-m\\ {ENTRY_MODULE}\\ deepspeed.launcher.", 1)
    return [*pdsh_command[:at], ENTRY_MODULE, *pdsh_command[at:]], [*kill_command[:-1], pattern]


def _node_launchers_through_entry() -> None:
    # This process is DeepSpeed's runner and nothing else: its pdsh runner class is changed for it alone.
    from deepspeed.launcher.multinode_runner import PDSHRunner

    get_cmd = PDSHRunner.get_cmd

    def get_cmd_through_entry(self, environment, active_resources):  # type: ignore[no-untyped-def]
        pdsh_command, kill_command, environment = get_cmd(self, environment, active_resources)
        return (*through_entry(pdsh_command, kill_command), environment)

    PDSHRunner.get_cmd = get_cmd_through_entry


if __name__ == "__main__":
    main()
