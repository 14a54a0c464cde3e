"""The argument parser of every entry point: a bad command line is one `error:` line and exit status 2.

Stock argparse answers a bad argument with its usage block (up to a dozen lines) and then the error; every
other refusal of the program is one `error: <message>` line with exit status 2 (txl_dist/entry.py,
docs/refusals.md), so the command line's are too:

    error: argument --max-new-tokens: invalid int value: 'abc' (see launch/generate.py --help)

--help still prints the whole help. Sub-commands' parsers (add_subparsers) are of the same class. Under a
launcher every rank parses the same command line, so each prints the line, as each does for a configuration
refused before the ranks meet. Standard library only: an entry point may build its parser before importing torch.
"""
from __future__ import annotations

import argparse
from typing import NoReturn

from .errors import EXIT_REFUSED  # standard library only too; 2, argparse's own status for a bad command line


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one line: `error: <argparse's message> (see PROG --help)`."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(str(message).split())  # one line, whatever a type function's message holds
        self.exit(EXIT_REFUSED, f"error: {text} (see {self.prog} --help)\n")

