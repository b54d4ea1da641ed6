"""The `pycalm` command: pycalm generate | convert | serve | cache | fetch [options], pycalm --version.

Each subcommand is a module's main (pycalm.app.generate, pycalm.convert.main, pycalm.app.serve,
pycalm.app.cache, pycalm.app.fetch), given the rest of the command line.
"""

from __future__ import annotations

import sys

from pycalm import __version__

USAGE = """usage: pycalm [--version] COMMAND [options]

commands:
  generate   generate text, chat, or measure perplexity (pycalm generate --help)
  convert    convert a Hugging Face folder or GGUF file to a pycalm file
  serve      serve a model over an OpenAI-compatible HTTP API
  cache      list the cached models (their size and source) or clear them
  fetch      download a known model's GGUF file into the cache
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"pycalm {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "generate":
        from pycalm.app.generate import main as run
    elif command == "convert":
        from pycalm.convert.main import main as run
    elif command == "serve":
        from pycalm.app.serve import main as run
    elif command == "cache":
        from pycalm.app.cache import main as run
    elif command == "fetch":
        from pycalm.app.fetch import main as run
    else:
        print(
            f"error: unknown command {command!r}: one of generate, convert, serve, cache, fetch (see pycalm --help)",
            file=sys.stderr,
        )
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
