"""What a person sees of every stage: the terminal, the notebooks' views and TensorBoard.

``terminal`` is the demo's view of a long run (one line per notebook, a ticking step bar), ``views`` the
notebooks' tables and plots, ``step_bar`` a notebook's one live progress bar, ``tensorboard`` serves and reads
the event files.
"""
