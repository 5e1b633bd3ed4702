"""The run directory's format, what the master and the ranks both read about a run.

``checkpoints`` says which checkpoints are complete and can be resumed, and names the completion marker;
``universal`` converts a checkpoint to another world size (DeepSpeed's universal format); ``master_state`` is the
run's master-private directory, where the master keeps what it later trusts (never in the shared run directory).
"""
