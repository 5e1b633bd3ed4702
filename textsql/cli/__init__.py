"""The ``textsql`` command line: one click group, ``cli``, whose commands call the package's stages.

``main`` defines the group, its own options and the order of its commands; each stage's commands have their
module: ``data`` (prepare), ``training`` (train, launch, estimate, tensorboard), ``inference`` (infer, evaluate),
``pipeline`` (demo, preflight) and ``workers`` (rendezvous serve/register, workers cleanup). ``options`` holds
the option machinery they share (options taken from the arguments dataclasses, the profile type), ``help`` how
the command presents itself (sections, environment variables, ``textsql train -h``).

Each command imports its stage inside its body, so ``textsql --help`` imports no training stack.
"""

from textsql.cli.main import cli

__all__ = ["cli"]
