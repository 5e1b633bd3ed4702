"""Names, limits and defaults shared across the package (kept here, not inline)."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "assets"
# The embedded default model: a small T5 built from a config, with the real T5 vocabulary.
DEFAULT_MODEL_DIR = ASSETS_DIR / "t5-tiny"
# A real WikiSQL sample in the original release layout ({split}.jsonl + {split}.tables.jsonl).
SAMPLE_DATA_DIR = ASSETS_DIR / "wikisql_sample"
# The repository root when running from a checkout (dsconfig/, notebooks/ live there).
PROJECT_DIR = PACKAGE_DIR.parent
# Another directory of profiles in place of dsconfig/ (textsql.planning.profiles); ranks inherit it.
DSCONFIG_DIR_VAR = "TEXTSQL_DSCONFIG_DIR"

# WikiSQL's own encodings (lib/query.py in the release).
AGG_OPS = ("", "MAX", "MIN", "COUNT", "SUM", "AVG")
COND_OPS = ("=", ">", "<")

SPLITS = ("train", "validation", "test")
# File stem of each split in the original release layout.
RELEASE_SPLIT_FILES = {"train": "train", "validation": "dev", "test": "test"}

# A training batch's tensors: the question's, padded to its bucket's source bound, and the query's, to the target
# bound (textsql.training.batching); torch.compile marks the same ones dynamic (textsql.training.compiling).
SOURCE_KEYS = ("input_ids", "attention_mask")
TARGET_KEYS = ("labels", "decoder_input_ids", "decoder_attention_mask")

# Distributed run layout (ports and the run-dir files the workers write: worker.constants).
LAUNCH_LOG_NAME = "launch.log"
# What a training run writes at its end (textsql.training.train): engine, profile, steps, the trainer's log history.
RUN_SUMMARY_NAME = "run.json"
# The trained model (weights, tokenizer, model card) inside a run directory.
MODEL_SUBDIR = "model"
# The run's TensorBoard event files (textsql.training.events), inside its run directory.
TENSORBOARD_SUBDIR = "tensorboard"
# What inference writes (textsql.inference.predict): one line per question, and the scores beside it.
PREDICTIONS_NAME = "predictions.jsonl"
METRICS_NAME = "metrics.json"
# The workers' inventories as the master judged them, and the ranks' collective check (bus bandwidth).
CLUSTER_FILE_NAME = "cluster.json"
COLLECTIVE_FILE_NAME = "collective.json"
# What the master writes and later trusts lives in each run's master-private directory (textsql.rundir.master_state.master_dir),
# never in the run directory the workers may write: the ranks' environment for DeepSpeed's runner, the ids of the
# launches whose processes a continuation ends, the running launch's hosts (whose first one's step lines the
# displays believe), the pipeline's record (textsql.pipeline.manifest.MANIFEST_NAME).
LAUNCH_IDS_NAME = "launch_ids"
# MLflow tracking (textsql.launching.tracking_env on the master, textsql.tracking.mlflow_runs on the logging rank):
# the launching environment's MLFLOW_* variables reach the rank in a 0600 file of the output directory, named
# to the ranks by TRACKING_ENV_VAR, never on a command line; the run's MLflow run id is kept beside run.json, and by
# the master in the run's master-private directory (textsql.tracking.launch_runs), the copy it trusts.
TRACKING_PREFIX = "MLFLOW_"
TRACKING_ENV_VAR = "TEXTSQL_TRACKING_ENV"
TRACKING_ENV_NAME = ".tracking_env.json"

# WikiSQL as text for T5 (textsql.data.sql, textsql.data.wikisql, textsql.data.prepare).
# T5's SentencePiece vocabulary has no "<" (it encodes to <unk>), so the "less than" operator is
# written as LT in the target text; "=" and ">" are in the vocabulary and stay as they are.
COND_OP_TEXT = ("=", ">", "LT")
# The most conditions a WikiSQL query has (dev and test: 66 and 148 questions have 4, none more).
MAX_CONDITIONS = 4
SQL_TABLE_NAME = "table"
# Model input forms: the question with the table's column headers (default), the question alone, or
# "uncased": the question and headers in lower case, and the query written in lower case, so a column
# the question names tokenizes alike in question, header and query (what a model from random weights
# must learn to copy; the product's scores compare case-insensitively already).
UNCASED_FORMAT = "uncased"
INPUT_FORMATS = ("schema", "question", UNCASED_FORMAT)
DEFAULT_MAX_SOURCE_LENGTH = 512
PREPARE_JSON_NAME = "prepare.json"
# Notebook 03's answers to a second, real source's questions (its `real_source`), beside predictions.jsonl.
REAL_PREDICTIONS_NAME = "real_predictions.jsonl"
REAL_METRICS_NAME = "real_metrics.json"
LABEL_PAD_TOKEN_ID = -100
# Relaunches the supervisor allows after a failed launch (textsql.launching.recovery).
DEFAULT_MAX_RESTARTS = 3
# Seconds a lost worker's replacement has to register (or a static host to answer again).
DEFAULT_REPLACE_TIMEOUT_S = 300.0
# Seconds no rank may advance before the supervisor ends and relaunches the run; None: a few times the
# slowest step seen, at least 2 minutes (textsql.launching.stall).
DEFAULT_STALL_TIMEOUT_S: float | None = None
# The data sources given by name (textsql.data.wikisql): the sample this package ships, and the hub's WikiSQL.
SAMPLE_SOURCE = "sample"
HUB_SOURCE = "hub"
