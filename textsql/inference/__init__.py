"""Stage 4, notebook 03 (`textsql infer`): SQL for questions, from a trained model.

``predictor`` is the model that writes SQL for questions in batches (and answers one question), ``predict`` runs
it over a split's questions, writes the predictions and scores them (:mod:`textsql.scoring`), ``guidance`` picks
the first beam whose query runs on the table's rows and finds something, ``serving`` answers one question as a
served model (the CML Model) does.
"""
