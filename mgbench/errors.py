"""The one error type the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """Bad input the user can fix: unknown alias, missing file, invalid option value."""
