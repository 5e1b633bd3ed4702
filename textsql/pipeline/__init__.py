"""The notebook pipeline: notebooks 01 → 02 → 03 run in order as papermill jobs (`textsql demo`, the AMP's jobs).

``demo`` runs the whole pipeline on the embedded default and prints its summary, ``runs`` executes one notebook
with its parameters, ``parameters`` reads and checks each notebook's parameters cell (and names the training
defaults notebook 02's repeat), ``manifest`` records the pipeline's progress in ``pipeline.json`` and plans what a
continuation runs again, and ``leftovers`` ends what a hard-killed earlier attempt left running.
"""
