"""Ways to start worker pods: ``local``, ``cml``, ``kubernetes``, ``slurm``, ``static``; see :func:`make_backend`.

``base`` is the interface every backend implements; ``kubernetes_manifests`` and ``kubernetes_policy`` are the Pod
and Secret objects and the NetworkPolicy the ``kubernetes`` backend writes, built from its ``kubernetes_options``;
``slurm_options`` are the ``slurm`` backend's, and ``slurm_node`` is what its jobs run on their nodes.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from worker.backends.base import Backend, Resources, WorkerHandle
from worker.errors import WorkerError

logger = logging.getLogger(__name__)

BACKENDS = {
    "local": "worker.backends.local:LocalBackend",
    "cml": "worker.backends.cml:CMLBackend",
    "kubernetes": "worker.backends.kubernetes:KubernetesBackend",
    "slurm": "worker.backends.slurm:SlurmBackend",
    "static": "worker.backends.static:StaticBackend",
}

__all__ = ["BACKENDS", "Backend", "Resources", "WorkerHandle", "make_backend"]


def make_backend(name: str, **options: Any) -> Backend:
    """A backend by name, built with its own options.

    :param name: one of ``BACKENDS``.
    :param options: that backend's options (:meth:`Backend.from_options`: by default its constructor's keyword
        arguments).
    :rtype: Backend
    """
    if name not in BACKENDS:
        raise WorkerError(f"unknown worker backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        backend: Backend = getattr(importlib.import_module(module), cls).from_options(**options)
        return backend
    except TypeError as error:
        raise WorkerError(f"bad option for the {name!r} backend: {error}") from None
