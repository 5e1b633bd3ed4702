"""Stage 3, notebook 02 (`textsql train` on every rank): the rank program and what shapes its run.

``train`` is the rank program (Seq2SeqTrainer on a DeepSpeed engine); ``trainer`` its evaluation with
grammar-constrained generation and ``metrics`` that evaluation's WikiSQL scores; ``profiles`` and
``estimate`` the DeepSpeed profiles of ``dsconfig/`` and their memory estimate (profile ``auto``);
``hardware`` and ``batching`` the defaults taken from the GPU and token-budget batches; ``checkpoints``
which checkpoints can be resumed; ``events`` and ``progress`` what a run writes to TensorBoard and prints;
``tracking`` its one MLflow run (``--report_to mlflow``).
"""
