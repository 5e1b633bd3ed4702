"""Stage 1, notebook 01 (`textsql prepare`): WikiSQL in, tokenized dataset out.

``wikisql`` loads the sources (the shipped sample, the hub, a release directory) and renders the model's
input and target text, ``sql`` turns SQL text into WikiSQL's structured query and back, ``synthetic``
writes WikiSQL-style questions over the shipped sample's tables (``--source synthetic``), ``prepare``
tokenizes and saves the splits with their tables.
"""
