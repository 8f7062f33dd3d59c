"""Runs on disk: run options, table schemas, run directories, parts and resume, shards and
placement, out-of-memory splitting, the machine a run was measured on."""
