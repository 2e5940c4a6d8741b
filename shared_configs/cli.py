"""Command-line helpers shared by every CLI: a parser whose errors are one line, and number types.

Bad input is one line on stderr, ``error: <flag>: <what is wrong>``, and exit status 2; no usage
block, no traceback. Framework-free (no torch or jax import), so every CLI can import it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

Number = int | float


class OneLineParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are ``error: ...`` on one line, exit status 2."""

    def error(self, message: str) -> NoReturn:  # argparse prints usage + message; we want one line
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _number(kind: type, lowest: Number, inclusive: bool) -> Callable[[str], Number]:
    bound = f">= {lowest}" if inclusive else f"> {lowest}"

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < lowest or (value == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {bound}")
        return value

    return parse


def positive(kind: type) -> Callable[[str], Number]:
    """An argparse ``type``: ``kind`` (int or float), finite and > 0 (``nan``, ``inf`` refused)."""
    return _number(kind, 0, inclusive=False)


def nonnegative(kind: type) -> Callable[[str], Number]:
    """An argparse ``type``: ``kind`` (int or float), finite and >= 0."""
    return _number(kind, 0, inclusive=True)
