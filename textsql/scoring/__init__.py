"""WikiSQL's own metrics, shared by training's evaluation (notebook 02) and inference (notebook 03).

``engine`` runs a structured query on a table's rows as the official engine does, ``evaluate`` scores
predictions by logical form and execution and formats the report.
"""
