"""mgbench: measure batch-invariance of greedy LLM decoding and the MarginGate policy."""

__version__ = "0.1.0"

# Bumped whenever a column of steps.parquet / sequences.parquet changes meaning or type.
# 2: steps gained method and logprob_drift; black-box runs leave unmeasurable columns null.
# 3: sequences gained solo_margins (top-1 minus top-2 of every solo step; null in older runs).
# 4: verify's sequences gained the replay records (replays, replayed, rollbacks, discarded).
# 5: the flips tables gained axis (what the audit varied: batch, prefix-cache, chunked-prefill).
SCHEMA_VERSION = "5"
