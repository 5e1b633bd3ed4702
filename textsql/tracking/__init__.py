"""Experiment tracking, shared by training (notebook 02) and inference (notebook 03): one MLflow run per
training run, which inference's scores join.

``mlflow_runs`` checks and loads the tracking settings a rank was handed, starts or continues the run, uploads
the model card and records an evaluation's scores; ``launch_runs`` is the master's side: which run a launch logs
into (a relaunch continues the training's), kept in the run's master-private directory, and a run a hard kill left
RUNNING marked KILLED. ``mlflow_free`` imports DeepSpeed without MLflow for the processes that never track.
"""
