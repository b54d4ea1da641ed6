"""One exception type for problems a user can fix: the CLI prints its message as one line."""

import argparse
import re
from typing import NoReturn

_LINE_BREAKS = re.compile(r"\s*[\r\n]+\s*")


class PycalmError(Exception):
    """Bad input (missing file, corrupt model, unsupported architecture or dtype, prompt too long).

    The message is one line by construction: line breaks (from a wrapped library's message,
    say) become "; ", so that `error: <message>` is always a single line."""

    def __init__(self, message: object = "") -> None:
        super().__init__(one_line(str(message)))


def one_line(text: str) -> str:
    """text with its line breaks (and the blanks around them) replaced by '; '."""
    return _LINE_BREAKS.sub("; ", text.strip())


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one 'error: ...' line, like every other pycalm
    error, instead of the usage block first (--help still shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
