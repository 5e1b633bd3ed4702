"""Stage 3, notebook 02 (`textsql train` on every rank): the rank program and what shapes its run.

``train`` is the rank program (Seq2SeqTrainer on a DeepSpeed engine), ``command_line`` parses its flags and
``trainer`` is its trainer (no step past the end when resumed there) and evaluation with grammar-constrained
generation, whose WikiSQL scores ``metrics`` computes;
``profiles`` and ``estimate`` are the DeepSpeed profiles of ``dsconfig/`` and their memory estimate (profile
`auto`); ``hardware`` and ``batching`` the defaults taken from the GPU and token-budget batches, ``recipe``
the learning rate, schedule and warm-up by what the model is, ``schedule`` evaluations and checkpoints spaced by
training time, ``loss`` the loss, ``clipping`` gradient clipping on the reduced gradients and
``throughput`` the questions and tokens that ran; ``checkpoints`` says which checkpoints can be resumed and
``mark_complete`` marks each one once every rank saved it; ``universal`` converts one to another world size;
``output_dir`` refuses or clears a previous run's directory, picks the checkpoint to resume and writes ``model/``;
``collective`` times the first collectives and ``shared_buffer`` frees the CPU all-reduce's shared memory;
``events`` and ``progress`` are what a run writes to TensorBoard and prints, ``time_left`` its estimate of the
time to the last step.
"""
