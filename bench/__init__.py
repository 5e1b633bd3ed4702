"""Benchmarks: our way against the seed notebook's way, measured side by side in one run (``make bench``).

Each figure lives in its own module and returns a dict (its numbers, how they were measured, and the
ratio that counts); :mod:`bench.__main__` runs them in order and :mod:`bench.report` writes
``bench/results.json`` and ``bench/README.md``. On a shared machine absolute times are noise: the two
arms of a comparison run in the same process, alternated, and the figure is the ratio of medians.
"""
