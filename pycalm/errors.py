"""One exception type for problems a user can fix: the CLI prints its message as one line."""


class PycalmError(Exception):
    """Bad input (missing file, corrupt model, unsupported architecture or dtype, prompt too long)."""
