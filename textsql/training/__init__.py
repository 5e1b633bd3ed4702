"""Stage 3, notebook 02 (`textsql train` on every rank): the rank program and what shapes its run.

``train`` is the rank program (Seq2SeqTrainer on a DeepSpeed engine; its command line is parsed by
:mod:`textsql.planning.train_args`) and ``trainer`` is its trainer (no step past the end when resumed there) and
evaluation with grammar-constrained generation, whose WikiSQL scores ``metrics`` computes; ``hardware`` shares a
CPU node's threads among its ranks and tears the process group down, ``batching`` fills token-budget batches,
``schedule`` spaces evaluations and checkpoints by training time, ``compiling`` is what a rank does under
torch.compile, ``loss`` is the loss, ``clipping`` gradient
clipping on the reduced gradients and ``throughput`` the questions and tokens that ran; ``mark_complete`` marks
each checkpoint once every rank saved it (the format is :mod:`textsql.rundir`'s); ``output_dir`` refuses or clears
a previous run's directory, picks the checkpoint to resume and writes ``model/``; ``collective`` times the first
collectives and ``shared_buffer`` frees the CPU all-reduce's shared memory; ``events`` and ``progress`` are what a
run writes to TensorBoard and prints, ``time_left`` its estimate of the time to the last step.

The master side (``textsql.cli``, ``textsql.pipeline``, ``textsql.launching``, ``textsql.store``) never imports
this package: it plans with :mod:`textsql.planning` and reads runs with :mod:`textsql.rundir`.
"""
