"""Stage 1, notebook 01 (`textsql prepare`): WikiSQL in, tokenized dataset out.

``wikisql`` loads the sources (the shipped sample, the hub, a release directory, the synthetic ones) and renders
the model's input and target text, ``sql`` turns SQL text into WikiSQL's structured query and back, ``prepare``
tokenizes and saves the splits with their tables. ``synthetic`` samples the synthetic sources' tables, questions
and splits from a seed, writing the questions' English from ``synthetic_templates`` and their tables' cells with
``synthetic_cells``; ``tables`` reads WikiSQL's tables files and checks that a directory holds a prepared dataset.
"""
