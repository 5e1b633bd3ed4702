"""The objects the ``kubernetes`` backend writes for a run's workers: one token Secret and one Pod per worker
(the run's NetworkPolicy is :mod:`worker.backends.kubernetes_policy`). No API calls here: these are the
official client's (validating) models, built from the backend's
:class:`~worker.backends.kubernetes_options.KubernetesOptions` and the run.

A pod gets its own rendezvous key as a Secret mounted read-only (0440, group = the pod's ``fsGroup``; the
pod spec never holds the value, the run's token stays with the master), ``POD_IP`` and the pod name from
the downward API, ``nvidia.com/gpu`` limits, and runs the image's non-root user with no privilege
escalation, no capabilities, the runtime's default seccomp profile and a read-only root filesystem,
for at most ``max_runtime_s``.

With a project claim the pod mounts the project at the master's path (DeepSpeed's pdsh launcher ``cd``s
there on every worker) **read-only**, and the run directory alone read-write over it: a rank writes
checkpoints, TensorBoard events, ``model/`` and the run record there and nowhere else on shared storage,
so no worker can change the code the master imports (``textsql/``, ``worker/``, the notebooks).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kubernetes import client

from worker import constants as c
from worker.backends.base import Resources
from worker.backends.kubernetes_options import KubernetesOptions
from worker.errors import WorkerError

TOKEN_MOUNT = "/var/run/textsql"
# Every worker Pod, token Secret and NetworkPolicy carries the app label and its run's label: cleanup finds
# them by these.
APP_LABELS = {"app.kubernetes.io/name": "textsql-worker"}
RUN_LABEL = "textsql/run"
APP_LABEL = ",".join(f"{key}={value}" for key, value in APP_LABELS.items())
SECRET_KEY = "token"
TMP = "/tmp"  # an emptyDir: the pod's root filesystem is read-only


def dns_name(text: str) -> str:
    """``text`` as the start of a DNS label (a run id): lower case, letters, digits and dashes, at most 40."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40] or "run"


def run_labels(run_id: str) -> dict[str, str]:
    """The labels of every object of run ``run_id``."""
    return {**APP_LABELS, RUN_LABEL: run_id}


def secret_name(pod: str) -> str:
    """The name of the Secret holding ``pod``'s key.

    :param pod: the pod's name.
    :rtype: str
    """
    return f"{pod}-key"


def pod_name(run_id: str, index: int) -> str:
    """Worker ``index``'s pod name (a replacement's adds ``-rK``)."""
    return f"textsql-{run_id}-{index}"


def secret_manifest(run_id: str, pod: str, key: str) -> Any:
    """The Secret holding one pod's rendezvous key, mounted by that pod only.

    :param run_id: the run's id (its label).
    :param pod: the pod's name.
    :param key: its key (:func:`~worker.rendezvous.token.pod_key`).
    :rtype: kubernetes.client.V1Secret
    """
    return client.V1Secret(
        api_version="v1",
        kind="Secret",
        type="Opaque",
        string_data={SECRET_KEY: key},
        metadata=client.V1ObjectMeta(name=secret_name(pod), labels=run_labels(run_id)),
    )


# The one directory of the project volume whose subdirectories pods may be given to write: an allow-list, where
# refusing what looks like code (a package, notebooks/, .venv, .git, cml/, scripts/) would always miss one.
RUNS_ROOT = "runs"
# What a run directory given to pods must not already hold: what the master or a person runs.
RUNNABLE = ("*.py", "*.ipynb", "*.sh", ".git", "pyvenv.cfg", "*/pyvenv.cfg")


def run_dir_subpath(project_path: str, run_dir: Path) -> str:
    """Where ``run_dir`` lies on the project volume, as a ``subPath``; refused where workers writing it could
    change what the master runs.

    :param project_path: where the project volume is mounted (on the master and in the pods).
    :param run_dir: the run directory, as the master sees it.
    :rtype: str
    :raises WorkerError: if the run directory is not strictly inside the project, lies in a Python package, is not
        a directory of its own under the project's ``runs/``, or holds what the master or a person runs.
    """
    project, run = Path(project_path).resolve(), run_dir.resolve()
    if run == project or not run.is_relative_to(project):
        raise WorkerError(
            f"run directory {str(run_dir)!r} is not inside the project volume {project_path!r}: worker pods "
            f"write only their run directory there; pass a run_dir under it, such as {project_path}/runs/NAME"
        )
    relative = run.relative_to(project)
    for depth in range(1, len(relative.parts) + 1):
        directory = project.joinpath(*relative.parts[:depth])
        if (directory / "__init__.py").exists():
            raise WorkerError(
                f"run directory {str(run_dir)!r} lies in the Python package {str(directory)!r}, code the master "
                f"imports, which worker pods must not write; pass a run_dir outside it, such as {project_path}/runs/NAME"
            )
    if relative.parts[0] != RUNS_ROOT or len(relative.parts) < 2:
        raise WorkerError(
            f"run directory {str(run_dir)!r} is not under the project's {RUNS_ROOT}/ directory, the one place worker "
            f"pods may write (notebooks, environments, .git and scripts lie elsewhere); pass a run_dir such as "
            f"{project_path}/{RUNS_ROOT}/NAME"
        )
    held = next((path for pattern in RUNNABLE for path in sorted(run.glob(pattern))), None) if run.is_dir() else None
    if held is not None:
        raise WorkerError(
            f"run directory {str(run_dir)!r} holds {str(held.relative_to(run))!r}, which the master or a person may "
            f"run, and worker pods would write; pass a run_dir of its own, such as {project_path}/{RUNS_ROOT}/NAME"
        )
    return relative.as_posix()


def pod_manifest(
    options: KubernetesOptions, run_id: str, index: int, resources: Resources, env: dict[str, str], run_dir: Path | None
) -> Any:
    """The Pod for worker ``index``.

    :param options: the backend's options, what every worker pod has in common.
    :param run_id: the run's id (its label and the pod name's middle).
    :param index: the worker's index.
    :param resources: CPU, memory, GPUs.
    :param env: the agent's environment (any token is replaced by the pod's own Secret, mounted).
    :param run_dir: the run directory, the one place on the project volume the pod may write (needed with a
        project claim).
    :rtype: kubernetes.client.V1Pod
    """
    name = pod_name(run_id, index)
    mounts, volumes = _scratch_volumes(options, resources)
    mounts.insert(0, client.V1VolumeMount(name="token", mount_path=TOKEN_MOUNT, read_only=True))
    # 0440: with an fsGroup the kubelet makes the files group-readable anyway; say so, and check it.
    volumes.insert(
        0,
        client.V1Volume(
            name="token", secret=client.V1SecretVolumeSource(secret_name=secret_name(name), default_mode=0o440)
        ),
    )
    if options.project_claim:
        project_mounts, project_volume = _project_volume(options, run_dir)
        mounts += project_mounts
        volumes.append(project_volume)
    return client.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=client.V1ObjectMeta(name=name, namespace=options.namespace, labels=run_labels(run_id)),
        spec=client.V1PodSpec(
            containers=[
                _container(options, _environment(options, resources, env), _limits(options, resources), mounts)
            ],
            volumes=volumes,
            restart_policy="Never",
            service_account_name=options.service_account,
            node_selector=options.node_selector,
            automount_service_account_token=False,
            active_deadline_seconds=options.max_runtime_s,
            security_context=client.V1PodSecurityContext(
                run_as_non_root=True,
                run_as_user=options.user_id,
                run_as_group=options.group_id,
                fs_group=options.group_id,
                seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
            ),
        ),
    )


def _environment(options: KubernetesOptions, resources: Resources, env: dict[str, str]) -> list[Any]:
    """The agent's variables: ``env`` without the run token, the mounted key's path, and the downward API's."""
    plain = {
        **env,
        c.ENV_TOKEN_FILE: f"{TOKEN_MOUNT}/{SECRET_KEY}",
        c.ENV_TOKEN_GROUP: str(options.group_id),
        c.ENV_SLOTS: str(max(1, resources.gpus)),
        c.ENV_SSHD_KEYS_DIR: f"{TMP}/textsql-sshd",  # the home directory is read-only
    }
    plain.pop(c.ENV_TOKEN, None)
    fields = {"POD_IP": "status.podIP", c.ENV_POD: "metadata.name"}
    return [client.V1EnvVar(name=key, value=value) for key, value in sorted(plain.items())] + [
        client.V1EnvVar(
            name=key, value_from=client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path=path))
        )
        for key, path in fields.items()
    ]


def _limits(options: KubernetesOptions, resources: Resources) -> dict[str, str]:
    limits = {
        "cpu": str(resources.cpu),
        "memory": f"{resources.memory_gb:g}Gi",
        "ephemeral-storage": f"{options.ephemeral_storage_gb:g}Gi",
    }
    if resources.gpus:
        limits["nvidia.com/gpu"] = str(resources.gpus)
    return limits


def _scratch_volumes(options: KubernetesOptions, resources: Resources) -> tuple[list[Any], list[Any]]:
    """The pod's own writable places (mounts, volumes): the root filesystem is read-only, so the agent's and
    sshd's files go to /tmp, the ranks' caches (torch extensions, Hugging Face) to ~/.cache."""
    mounts = [
        client.V1VolumeMount(name="shm", mount_path="/dev/shm"),
        client.V1VolumeMount(name="tmp", mount_path=TMP),
        client.V1VolumeMount(name="cache", mount_path=f"{options.home}/.cache"),
    ]
    volumes = [
        # NCCL's shared-memory transport needs more than the runtime's 64 MB /dev/shm.
        client.V1Volume(
            name="shm",
            empty_dir=client.V1EmptyDirVolumeSource(
                medium="Memory", size_limit=f"{max(1.0, resources.memory_gb / 2):g}Gi"
            ),
        ),
        client.V1Volume(name="tmp", empty_dir=client.V1EmptyDirVolumeSource(size_limit="1Gi")),
        client.V1Volume(
            name="cache",
            empty_dir=client.V1EmptyDirVolumeSource(size_limit=f"{max(1.0, options.ephemeral_storage_gb / 2):g}Gi"),
        ),
    ]
    return mounts, volumes


def _project_volume(options: KubernetesOptions, run_dir: Path | None) -> tuple[list[Any], Any]:
    """The project claim's mounts (the project read-only, the run directory read-write over it) and volume."""
    if run_dir is None:
        raise WorkerError(
            "the kubernetes backend with a project_claim needs the run directory its pods may write; "
            "start the workers with start_workers(backend, count, run_dir) rather than backend.launch"
        )
    subpath = run_dir_subpath(options.project_path, run_dir)
    mounts = [
        client.V1VolumeMount(name="project", mount_path=options.project_path, read_only=True),
        client.V1VolumeMount(
            name="project", mount_path=str(Path(options.project_path) / subpath), sub_path=subpath, read_only=False
        ),
    ]
    claim = client.V1PersistentVolumeClaimVolumeSource(claim_name=options.project_claim)
    return mounts, client.V1Volume(name="project", persistent_volume_claim=claim)


def _container(options: KubernetesOptions, env: list[Any], limits: dict[str, str], mounts: list[Any]) -> Any:
    return client.V1Container(
        # args, not command: the image's entrypoint (tini) stays pid 1 and reaps sshd's children.
        name="agent",
        image=options.image,
        args=["python", "-m", "worker.agent"],
        env=env,
        working_dir=options.project_path,
        volume_mounts=mounts,
        resources=client.V1ResourceRequirements(requests=dict(limits), limits=limits),
        security_context=client.V1SecurityContext(
            run_as_non_root=True,
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            capabilities=client.V1Capabilities(drop=["ALL"]),
            seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
        ),
    )
