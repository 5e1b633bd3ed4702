"""textsql: fine-tune T5 for WikiSQL text-to-SQL with DeepSpeed across worker pods."""

__version__ = "0.1.0"
