"""What runs in a worker pod (agent, sshd) and what finds them (rendezvous, hostfile, backends)."""
