"""Command-line helpers shared by every CLI: a parser whose errors are one line, and number types.

Bad input is one line on stderr, ``<prog>: error: <flag>: <what is wrong>``, and exit status 2; no usage
block, no traceback. Framework-free (no torch or jax import), so every CLI can import it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

Number = int | float


class OneLineParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line, ``<prog>: error: <message>`` (argparse's
    own format without the usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(kind: type, lowest: Number, inclusive: bool, unit: str) -> Callable[[str], Number]:
    what = f"a {'non-negative' if inclusive else 'positive'} {'integer' if kind is int else 'number'}{unit}"

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < lowest or (value == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def positive(kind: type, unit: str = "") -> Callable[[str], Number]:
    """An argparse ``type``: ``kind`` (int or float), finite and > 0 (``nan``, ``inf`` refused);
    ``unit`` (e.g. ``" of MiB"``) ends the error's description."""
    return _number(kind, 0, inclusive=False, unit=unit)


def nonnegative(kind: type, unit: str = "") -> Callable[[str], Number]:
    """An argparse ``type``: ``kind`` (int or float), finite and >= 0."""
    return _number(kind, 0, inclusive=True, unit=unit)
