"""The ``kubernetes`` backend's options: what notebook 02's ``backend_options`` holds for it, key by key.

The pods' image, namespace, project volume, user and limits (the manifests of
:mod:`worker.backends.kubernetes_manifests` are built from them), how often the backend looks at the pods, and
which destinations beyond the run's own the NetworkPolicy (:mod:`worker.backends.kubernetes_policy`) admits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KubernetesOptions:
    """How the ``kubernetes`` backend starts its worker pods.

    Usage (notebook 02; :meth:`~worker.backends.kubernetes.KubernetesBackend.from_options` builds it)::

        backend_options = {"image": "REGISTRY/textsql:TAG", "namespace": "ml", "project_claim": "textsql-project"}
    """

    image: str
    """The worker image (the session's image: python, deepspeed, sshd, pdsh)."""
    namespace: str = "default"
    """Namespace for the pods, their Secrets and the run's NetworkPolicy."""
    project_claim: str | None = None
    """PersistentVolumeClaim holding the project (None: the image has it). The pods mount it read-only, and the run
    directory (which must lie inside it) read-write."""
    project_path: str = ""
    """Where the project is mounted; empty: this process's working directory when the options are made (DeepSpeed's
    pdsh launcher ``cd``s to the master's own directory on every worker)."""
    service_account: str | None = None
    """The pods' service account (its token is never mounted)."""
    node_selector: dict[str, str] | None = None
    """The pods' node selector (e.g. a GPU node pool)."""
    user_id: int = 1000
    """The image's non-root user (docker/Dockerfile: 1000)."""
    group_id: int = 1000
    """The pods' fsGroup: the group of the mounted key and of the pods' processes."""
    max_runtime_s: int = 24 * 3600
    """``activeDeadlineSeconds``: the pods end after this even if no one stops them."""
    home: str = "/home/textsql"
    """The image user's home directory (docker/Dockerfile: /home/textsql); its ``.cache`` is writable."""
    ephemeral_storage_gb: float = 20.0
    """Each pod's limit on node-local disk (its writable volumes and logs)."""
    poll_s: float = 2.0
    """Seconds between looks at the pods' status."""
    egress: Sequence[str] = ()
    """Further destinations the pods may reach, each ``IP[/PREFIX]:PORT`` (a hub mirror, a tracking server); the
    NetworkPolicy admits nothing else."""
    egress_to_tracking: bool = False
    """Also admit the host and port of this process's ``MLFLOW_TRACKING_URI`` (the rank that logs to MLflow runs
    on a pod)."""

    def __post_init__(self) -> None:
        if not self.project_path:  # None too: a notebook may spell the default out
            object.__setattr__(self, "project_path", str(Path.cwd()))
