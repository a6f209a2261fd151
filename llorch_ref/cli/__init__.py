"""llorch-ref command line: generate, chat, serve, bench, inspect, convert, diff, dump, prove.

A thin face: the parser (cli.parser) maps options to the functions that do the work (cli.commands,
cli.comparisons); errors of every kind end as one line `error: ...` and exit 2.
"""
from __future__ import annotations

import sys

from ..errors import LlorchError
from ..harness.text_safety import for_terminal
from .common import preflight
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv=None):
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:       # reported by the command's own parser, with its usage (not the top-level one)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        preflight(args)
        return args.fn(args)
    except LlorchError as e:
        print(f"error: {for_terminal(e)}", file=sys.stderr)      # the message may name what a file holds
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
