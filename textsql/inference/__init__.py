"""Stage 4, notebook 03 (`textsql infer`): SQL for questions, from a trained model.

``predict`` writes SQL for a split's questions in batches and scores them (:mod:`textsql.scoring`),
``guidance`` picks the first beam whose query runs on the table's rows and finds something, ``serving`` answers
one question as a served model (the CML Model) does.
"""
