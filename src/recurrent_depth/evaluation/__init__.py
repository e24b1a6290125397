"""Evaluation: quality against depth, synthetic reasoning tasks, the lm-evaluation-harness backend."""
