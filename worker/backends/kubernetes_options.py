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

# A week: above any run this project's guides plan (hours), so the deadline never ends a run that is still training;
# it ends only pods that no one stopped and whose agent did not exit either.
MAX_RUNTIME_S = 7 * 24 * 3600


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
    """Where the pods mount the project claim, and their working directory: the path the session sees the project
    at, since DeepSpeed's pdsh launcher ``cd``s to the master's own directory on every worker. Empty: this process's
    working directory when the options are made (right when the notebook runs from the project's root)."""
    service_account: str | None = None
    """The worker pods' service account (None: the namespace's ``default``). Its token is never mounted, so it grants
    the workers nothing: set it only where a cluster admits pods by service account (an image pull secret, a pod
    security or quota policy bound to one). The notebook's own service account is the one that needs the RBAC Role
    that creates the pods."""
    node_selector: dict[str, str] | None = None
    """The pods' node selector (e.g. a GPU node pool)."""
    user_id: int = 1000
    """The uid the pods run as (``runAsUser``): the image's non-root user (docker/Dockerfile: 1000). It must be the
    uid the session writes the project volume as, so the ranks can write the run directory there."""
    group_id: int = 1000
    """The pods' fsGroup: the group of the mounted key and of the pods' processes."""
    max_runtime_s: int | None = MAX_RUNTIME_S
    """``activeDeadlineSeconds``: Kubernetes ends the pods this many seconds after they start, whatever the run is
    doing (None: never). A backstop for pods nobody stops: a pod's agent exits by itself when the notebook's kernel
    goes away. The launch logs it, and a pod it ended is reported as such. Set it above the longest run you plan."""
    home: str = "/home/textsql"
    """The image user's home directory (docker/Dockerfile: /home/textsql); its ``.cache`` is writable."""
    ephemeral_storage_gb: float = 20.0
    """Each pod's request and limit on the node's local disk, in GiB: its ``/tmp`` (1 GiB), its ``~/.cache`` (half of
    this: compiled kernels, torch extensions) and its logs. A pod that writes more is evicted; checkpoints and the
    model go to the run directory on the project volume, which this does not count."""
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
