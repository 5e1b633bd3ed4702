"""DeepSpeed's own launcher programs, run as ``python -m`` runs them but without MLflow.

``python -m textsql.launching.deepspeed_entry deepspeed.launcher.runner ARGS`` is the ``deepspeed ARGS`` command
(:func:`textsql.launching.command.deepspeed_command`), and ``... deepspeed.launcher.launch ARGS`` the per-node
launcher of a local launch (:func:`textsql.launching.command.local_command`). Either imports all of DeepSpeed, and
with it the MLflow its autotuner imports (:mod:`textsql.tracking.mlflow_free`): 1.45 of the runner's 3.0 CPU
seconds before it starts pdsh, on 2 cores. Neither program tracks or autotunes; their code runs unchanged. The
per-node launchers pdsh starts on the hosts run DeepSpeed's own command line and still import it.
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
    # As `python -m PROGRAM ARGS`: sys.argv[0] becomes the program's file, and its arguments follow.
    sys.argv[1:] = arguments
    runpy.run_module(program, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
