"""Decoding inside WikiSQL's grammar, shared by training's evaluation (notebook 02) and inference (notebook 03).

``grammar`` compiles each table's WikiSQL grammar into a token automaton, ``spellings`` the forms a
condition value may take, ``processor`` the LogitsProcessor that keeps generation in the grammar, and
``bounds`` the generation length bound taken from the gold queries.
"""
