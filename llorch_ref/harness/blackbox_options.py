"""The options of a black-box subject (openai:URL, mistralrs), declared once for the command line (`--subject`)
and the pytest plugin (`--llorch-subject`): `add` is argparse's add_argument or pytest's addoption (one
signature), `prefix` the faces' option prefix ('--' or '--llorch-'), `count` the type of a count option."""
from __future__ import annotations


def add_timeout_option(add, prefix: str):
    add(f"{prefix}timeout", type=float, default=300.0,
        help=f"{prefix}subject openai:URL: seconds to wait for each answer (default 300)")


def add_blackbox_options(add, prefix: str, count=int):
    add(f"{prefix}top-logprobs", type=count, default=None, metavar="K",
        help=f"{prefix}subject openai:URL|mistralrs: log-probabilities asked a step (default: 20 of a server, the "
             "whole vocabulary of mistral.rs); under the vocabulary the KLD is a lower bound")
    add(f"{prefix}chat", action="store_true",
        help=f"{prefix}subject openai:URL: the chat route (the server's template) instead of the raw prompt")
    add_timeout_option(add, prefix)
