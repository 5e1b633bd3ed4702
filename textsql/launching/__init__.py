"""Stage 3, notebook 02 (`textsql launch`): DeepSpeed's pdsh launcher over the workers' hostfile.

``launch`` runs one launch (checks, ``.deepspeed_env``, the runner, the live log), ``command`` builds its
command line and the ranks' environment, ``tracking_env`` hands MLflow's settings to the logging rank in a
0600 file, ``preflight`` says what the runtime lacks, ``cluster_check`` refuses a cluster that cannot train
before pdsh starts, ``ranks`` finds a launch's processes, ``supervisor`` relaunches from the newest complete
checkpoint when a worker is lost, ``stall`` tells a stalled run from a slow one, and ``hostfile_hosts`` gives
the supervisor the hosts of an existing hostfile.
"""
