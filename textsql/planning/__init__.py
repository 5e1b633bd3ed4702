"""Planning a training run, on the launching machine and on every rank alike: what both must decide the same way.

``train_args`` is the one parser of the training command line (every spelling of every flag, the profile as the
DeepSpeed config, the precision resolved), used by the ranks and, once per launch, by the master's plan;
``profiles`` and ``estimate`` are the DeepSpeed profiles of ``dsconfig/`` and their memory estimate (profile
`auto`); ``recipe`` the learning rate, schedule and warm-up by what the model is; ``device_defaults`` the defaults
taken from the GPU in front of them; ``world`` the rank's world as the launcher tells it. Nothing here imports the
rank program (``textsql.training``) or starts anything distributed.
"""
