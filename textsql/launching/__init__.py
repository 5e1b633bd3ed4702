"""Stage 3, notebook 02 (`textsql launch`): DeepSpeed's pdsh launcher over the workers' hostfile.

``launch`` runs one launch (checks, ``.deepspeed_env``, the runner, the live log), ``command`` builds its
command line and the ranks' environment, ``deepspeed_entry`` runs DeepSpeed's runner without MLflow, ``tracking_env`` hands MLflow's settings to the logging rank in a
0600 file, ``preflight`` says what the runtime lacks, ``ranks`` finds a launch's processes, and
``cluster_check`` refuses workers that cannot train together.

``supervisor`` keeps a run going: it runs each launch with its output read by ``launch_watch`` and stops it on
a stall that ``stall`` detects; after a failure, ``recovery`` decides what to do (replace a lost worker, go on
with fewer, relaunch from the newest complete checkpoint, give up), with ``failures`` saying what made a launch
fail and ``training_plan`` what the ranks' training arguments are, and which keep the batch on fewer ranks;
``hostfile_hosts`` lets it replace and drop the hosts of the user's own hostfile as it does a cluster's workers.
"""
