"""The run's NetworkPolicy: what a worker pod may receive and reach, whatever runs in it.

In: sshd's port from the master alone (pdsh and the probes come from there); every other TCP port (the
ranks' torch.distributed store, gloo's and NCCL's ephemeral ports) from the run's own pods.
Out: the master's rendezvous port (registration and the held session), the run's own pods on the same
ports as above (not each other's sshd: pdsh runs on the master only), and the cluster DNS (kube-dns in
``kube-system``, UDP and TCP 53). Nothing else: not the master's JupyterLab, TensorBoard or ssh, not the
node's or the cloud's metadata endpoint (169.254.169.254), not another namespace, not another run, not
the internet (a model from the hub must be on the project volume before the run: see the docs).

Opt-in, the backend's ``egress`` adds destinations by address and TCP port (``IP[/PREFIX]:PORT``, IPv6 in
brackets): an MLflow tracking server outside the cluster (``egress_to_tracking`` adds the host and port of the
master's ``MLFLOW_TRACKING_URI``, :func:`tracking_egress`), a hub mirror. A NetworkPolicy's ``ipBlock`` is
meant for addresses outside the cluster: for a server in it, plugins differ on Service IPs, so name its pods'
addresses.

The policy is only as good as the cluster's network plugin: one that does not enforce NetworkPolicy
(or not its egress side) ignores it silently.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client

from worker.backends.kubernetes_manifests import run_labels
from worker.errors import WorkerError

# The cluster DNS: CoreDNS and kube-dns both carry this label in kube-system on kubeadm, GKE, EKS and AKS.
DNS_NAMESPACE = "kube-system"
DNS_LABELS = {"k8s-app": "kube-dns"}
DNS_PORT = 53
# The ports of a tracking URI that names none.
DEFAULT_URL_PORTS = {"http": 80, "https": 443}
# One allowed destination: an address block (CIDR) and a TCP port.
Egress = tuple[str, int]


def policy_name(run_id: str) -> str:
    """The name of run ``run_id``'s NetworkPolicy."""
    return f"textsql-{run_id}-workers"


def parse_egress(entry: str) -> Egress:
    """An allowed destination ``IP[/PREFIX]:PORT`` (``[IPv6[/PREFIX]]:PORT``) as its address block and port.

    Usage::

        >>> parse_egress("10.0.3.7:5000")
        ('10.0.3.7/32', 5000)

    :rtype: tuple[str, int]
    :raises WorkerError: naming the form to use.
    """
    address, _, port = entry.rpartition(":")
    address = address[1:-1] if address.startswith("[") and address.endswith("]") else address
    try:
        block = ipaddress.ip_network(address, strict=False)
        number = int(port)
    except ValueError:
        block, number = None, 0
    if block is None or not 0 < number < 65536:
        raise WorkerError(
            f"egress {entry!r} is not IP[/PREFIX]:PORT; pass e.g. egress=['10.0.3.7:5000', '[fd00::7]:443'] "
            "(a NetworkPolicy admits addresses, not names)"
        )
    return str(block), number


def tracking_egress(uri: str) -> list[Egress]:
    """The destinations of an MLflow tracking URI: each address its host resolves to (here), with its port.

    :param uri: ``MLFLOW_TRACKING_URI`` (http or https).
    :rtype: list[tuple[str, int]]
    :raises WorkerError: for a URI that is no http(s) server, or a host that does not resolve.
    """
    parts = urlsplit(uri)
    if parts.scheme not in DEFAULT_URL_PORTS or not parts.hostname:
        raise WorkerError(
            f"MLFLOW_TRACKING_URI {uri.split('@')[-1]!r} is no http(s) server to allow egress to; "
            "set it to http(s)://HOST:PORT, or pass egress=['IP:PORT'] instead of egress_to_tracking"
        )
    port = parts.port or DEFAULT_URL_PORTS[parts.scheme]
    try:
        found = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise WorkerError(
            f"tracking host {parts.hostname!r} does not resolve here ({error}); pass egress=['IP:PORT'] instead"
        ) from None
    addresses = sorted({ipaddress.ip_address(str(info[4][0])) for info in found}, key=str)
    return [(f"{address}/{address.max_prefixlen}", port) for address in addresses]


def network_policy_manifest(
    namespace: str,
    run_id: str,
    master_address: str,
    rendezvous_port: int,
    ssh_port: int,
    egress: Sequence[Egress] = (),
) -> Any:
    """The run's NetworkPolicy, ingress and egress (see the module docstring).

    :param namespace: the run's namespace.
    :param run_id: the run's id (its pods' label).
    :param master_address: the master's pod IP (where pdsh and the probes come from, where the rendezvous listens).
    :param rendezvous_port: the master's rendezvous port.
    :param ssh_port: the workers' sshd port.
    :param egress: further destinations the workers may reach (:func:`parse_egress`, :func:`tracking_egress`).
    :rtype: kubernetes.client.V1NetworkPolicy
    """
    run_pods = client.V1LabelSelector(match_labels=run_labels(run_id))
    return client.V1NetworkPolicy(
        api_version="networking.k8s.io/v1",
        kind="NetworkPolicy",
        metadata=client.V1ObjectMeta(name=policy_name(run_id), namespace=namespace, labels=run_labels(run_id)),
        spec=client.V1NetworkPolicySpec(
            pod_selector=run_pods,
            policy_types=["Ingress", "Egress"],
            ingress=_ingress(run_pods, _master(master_address), ssh_port),
            egress=_egress(run_pods, _master(master_address), rendezvous_port, ssh_port)
            + [
                client.V1NetworkPolicyEgressRule(
                    to=[client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=block))],
                    ports=[client.V1NetworkPolicyPort(protocol="TCP", port=port)],
                )
                for block, port in egress
            ],
        ),
    )


def _master(address: str) -> Any:
    try:
        master = ipaddress.ip_address(address)
    except ValueError:
        raise WorkerError(
            f"master address {address!r} is not an IP address, and the run's NetworkPolicy admits the master by "
            "its IP; pass master_address=<the session pod's IP> or leave it out (POD_IP is used)"
        ) from None
    return client.V1NetworkPolicyPeer(ip_block=client.V1IPBlock(cidr=f"{master}/{master.max_prefixlen}"))


def _tcp_ports_except(port: int) -> list[Any]:
    """Every TCP port but ``port``: the ranks' ports are ephemeral, sshd's is the master's alone."""
    ranges = [(first, last) for first, last in ((1, port - 1), (port + 1, 65535)) if first <= last]
    return [client.V1NetworkPolicyPort(protocol="TCP", port=first, end_port=last) for first, last in ranges]


def _ingress(run_pods: Any, master: Any, ssh_port: int) -> list[Any]:
    return [
        client.V1NetworkPolicyIngressRule(
            _from=[master], ports=[client.V1NetworkPolicyPort(protocol="TCP", port=ssh_port)]
        ),
        client.V1NetworkPolicyIngressRule(
            _from=[client.V1NetworkPolicyPeer(pod_selector=run_pods)], ports=_tcp_ports_except(ssh_port)
        ),
    ]


def _egress(run_pods: Any, master: Any, rendezvous_port: int, ssh_port: int) -> list[Any]:
    dns = client.V1NetworkPolicyPeer(
        namespace_selector=client.V1LabelSelector(match_labels={"kubernetes.io/metadata.name": DNS_NAMESPACE}),
        pod_selector=client.V1LabelSelector(match_labels=DNS_LABELS),
    )
    return [
        client.V1NetworkPolicyEgressRule(
            to=[master], ports=[client.V1NetworkPolicyPort(protocol="TCP", port=rendezvous_port)]
        ),
        client.V1NetworkPolicyEgressRule(
            to=[client.V1NetworkPolicyPeer(pod_selector=run_pods)], ports=_tcp_ports_except(ssh_port)
        ),
        client.V1NetworkPolicyEgressRule(
            to=[dns],
            ports=[client.V1NetworkPolicyPort(protocol=protocol, port=DNS_PORT) for protocol in ("UDP", "TCP")],
        ),
    ]
