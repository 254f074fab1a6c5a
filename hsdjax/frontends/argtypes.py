"""Argument types for the command line (``hsdjax.frontends.cli``) and the serve options (``hsdjax.frontends.serve``): numbers
checked against their range, with a one-line error instead of a traceback."""

from __future__ import annotations

import argparse


def int_at_least(lo: int, hi: int = 1_000_000):
    """A whole number in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {value}")
        if value > hi:
            raise argparse.ArgumentTypeError(f"{value} is absurdly large (at most {hi})")
        return value

    return parse


def float_in(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False):
    """A number between lo and hi (each end closed unless ``*_open``); NaN is refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < value if lo_open else lo <= value) or not (value < hi if hi_open else value <= hi):
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, "
                                             f"got {value}")
        return value

    return parse
