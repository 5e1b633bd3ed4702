"""What several test modules share: paths, the commands they start, real terminals. Test modules import from
here (``from helpers.terminal import pseudo_terminal``), never from one another; pytest puts ``tests/`` on the path.
"""
