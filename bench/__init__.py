"""Benchmarks: our way against the seed notebook's way, measured side by side in one run (``make bench``).

Each figure lives in its own module and returns a dict (its numbers, how they were measured, and the
ratio that counts); :mod:`bench.__main__` runs them in order and :mod:`bench.report` writes
``bench/results.json`` and ``bench/README.md``. On a shared machine absolute times are noise: the two
arms of a comparison run in the same process, alternated, and the figure is the ratio of medians.

The modules, by what they are:

- **Figures** (each measures one comparison and returns its dict): ``tokenization``, ``train_padding``,
  ``inference``, ``model_latency``, ``rendezvous``, ``startup``, ``profiles``, ``recovery``, ``store``,
  ``setup_cost``, ``demo_seeds``, ``step_ops``, ``pretrained_proxy``, ``compile_warmup``, ``norms``,
  ``sliced_loss``, ``host_cost``; the GPU comparisons ``gpu`` and ``gpu_quick``, and ``gpu_quick``'s time to accuracy,
  ``accuracy``, with ``rate_scaling`` (its defaults' arm at a GPU's token budget, over rates and seeds).
- **Measured arms** (what a figure runs against each other): ``old_recipe`` (the seed notebook's plain
  ``Seq2SeqTrainer``), ``peer`` (a plain ``Seq2SeqTrainer`` tuned as transformers' docs advise), ``ours``
  (``textsql train`` with its defaults), ``rank_probe`` (one rank that records its own peak memory and step times),
  ``quick_arms`` (gpu-quick's arms, each measured alike); and what the GPU arms train on, ``workload`` and
  ``fullscale``.
- **Server stand-ins** (real servers started for a figure and for the tests): ``seaweed`` (an S3-compatible
  store).
- **Shared helpers**: ``timing`` (alternated repetitions, medians), ``steps`` and ``events`` (step times from inside
  the process and from TensorBoard's files), ``timeline`` (where a few steady steps spend the device's time, from
  torch.profiler), ``step_arms`` (the batch, precision, step times and command of the figures that compare arms on
  one T5 shape's training steps), ``flops`` (FLOPs and MFU), ``machine`` (what was measured on; a one-figure
  command's flags and JSON), ``report`` (results.json and the table), ``quick_report`` (gpu-quick's ratios and
  table), and ``tiny_run`` (the command line of a tiny training run).

What the tests share with the bench (``tiny_run``, ``seaweed``, the recovery run's builders, the GPU comparison's
parsers) is imported from these modules by name, since the bench never imports ``tests/``; everything else here
is the bench's own.
"""
