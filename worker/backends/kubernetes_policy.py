"""The run's NetworkPolicy: what a worker pod may receive and reach, whatever runs in it.

In: sshd's port from the master alone (pdsh and the probes come from there); every other TCP port (the
ranks' torch.distributed store, gloo's and NCCL's ephemeral ports) from the run's own pods.
Out: the master's rendezvous port (registration and the held session), the run's own pods on the same
ports as above (not each other's sshd: pdsh runs on the master only), and the cluster DNS (kube-dns in
``kube-system``, UDP and TCP 53). Nothing else: not the master's JupyterLab, TensorBoard or ssh, not the
node's or the cloud's metadata endpoint (169.254.169.254), not another namespace, not another run, not
the internet (a model from the hub must be on the project volume before the run: see the docs).

The policy is only as good as the cluster's network plugin: one that does not enforce NetworkPolicy
(or not its egress side) ignores it silently.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from kubernetes import client

from worker.backends.kubernetes_manifests import run_labels
from worker.errors import WorkerError

# The cluster DNS: CoreDNS and kube-dns both carry this label in kube-system on kubeadm, GKE, EKS and AKS.
DNS_NAMESPACE = "kube-system"
DNS_LABELS = {"k8s-app": "kube-dns"}
DNS_PORT = 53


def policy_name(run_id: str) -> str:
    """The name of run ``run_id``'s NetworkPolicy."""
    return f"textsql-{run_id}-workers"


def network_policy_manifest(
    namespace: str, run_id: str, master_address: str, rendezvous_port: int, ssh_port: int
) -> Any:
    """The run's NetworkPolicy, ingress and egress (see the module docstring).

    :param namespace: the run's namespace.
    :param run_id: the run's id (its pods' label).
    :param master_address: the master's pod IP (where pdsh and the probes come from, where the rendezvous listens).
    :param rendezvous_port: the master's rendezvous port.
    :param ssh_port: the workers' sshd port.
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
            egress=_egress(run_pods, _master(master_address), rendezvous_port, ssh_port),
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
