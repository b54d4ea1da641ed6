"""One exception type for problems a user can fix: the CLI prints its message as one line."""

import argparse
from typing import NoReturn


class PycalmError(Exception):
    """Bad input (missing file, corrupt model, unsupported architecture or dtype, prompt too long)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one 'error: ...' line, like every other pycalm
    error, instead of the usage block first (--help still shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
