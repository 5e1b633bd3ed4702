"""What an emulated engine or pod starts with before the platform adds its launch's variables: its image's
environment, emulated by this machine's runtime variables, by name.

On CML and Kubernetes a worker's process does not inherit the launching session's environment: it gets its image's
variables (interpreter, libraries, locale, home) and what the launch names (``launch_workers(env=...)``, the Pod's
``env``). A variable the session alone holds (a credential it was given, a test's ``monkeypatch.setenv``) must not
reach an emulated worker either, or the emulator would hide what the backend passes.
"""

from __future__ import annotations

import os

# The image's variables, as this machine has them: PATH and the virtualenv find this interpreter's packages,
# PYTHONPATH this checkout, TMPDIR and the caches the same places as the tests' own processes.
IMAGE_VARS = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LC_ALL",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "HF_HOME",
    "TORCH_EXTENSIONS_DIR",
)


def image_environment() -> dict[str, str]:
    """The variables a new engine or container starts with: :data:`IMAGE_VARS` as this process has them."""
    return {name: os.environ[name] for name in IMAGE_VARS if name in os.environ}
