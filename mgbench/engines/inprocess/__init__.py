"""The one decode engine every command runs: cache ops, forward steps, runners, policies.

It knows nothing of the CLI, the terminal or Parquet: runners return plain results and
per-step metric arrays that `mgbench.runs.schema` turns into tables.
"""
