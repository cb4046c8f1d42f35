"""Rollplex: synchronous on-policy RL post-training for vision-language models."""

__version__ = "0.1.0"
