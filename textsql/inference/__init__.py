"""Stage 4, notebook 03 (`textsql infer`, `textsql evaluate`): predictions and WikiSQL's own scores.

``predict`` writes SQL for a split's questions in batches, ``guidance`` picks the first beam whose query
runs on the table's rows and finds something, ``evaluate`` scores logical-form and execution accuracy.
"""
