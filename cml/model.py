"""CML Model: the trained model answers one question about a table over REST.

CML calls ``predict`` with the request's JSON as a dict (the ``"request"`` of the endpoint's
``{"accessKey": ..., "request": {...}}``): ``{"question": str, "header": [str, ...], "rows": [[...]] optional}``,
answered with ``{"sql": ..., "query": {"sel", "agg", "conds"}}``, plus ``"answer"`` (the query run over the rows in
SQLite) when rows are given, or ``{"error": "..."}`` in one line. The model is loaded on the first request and kept
(textsql.inference.serving): from ``TEXTSQL_MODEL_DIR``, else the AMP's training run ``$TEXTSQL_RUN_DIR/model``.
"""

from textsql.inference.serving import answer, one_line, served_model_dir, served_predictor


def predict(request):
    try:
        return answer(served_predictor(served_model_dir()), request)
    except Exception as error:  # noqa: BLE001 - the caller gets one line; a traceback in the model's log reaches nobody
        return {"error": one_line(f"{type(error).__name__}: {error}")}
