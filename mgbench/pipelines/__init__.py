"""What each command does, from validated run options to a published run directory (no Typer,
no exit codes): flips, calibrate, verify, compare, probe; the prepared run and the terminal
session they share."""
