"""The error types the CLI turns into one line on stderr and an exit code."""


class UserError(Exception):
    """Bad input the user can fix: unknown alias, missing file, invalid option value (exit 2)."""


class NothingToDo(Exception):
    """The work asked for is already done (a finished shard given --resume): one line, exit 0.

    Under torchrun a rank that exits nonzero tears down every other rank, so a rank whose shard
    finished before a crash must leave quietly while the others resume theirs."""
