"""argparse value types shared by the command-line tools."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {number}")
    return number


def plot_path(text: str) -> str:
    """argparse type: a PNG path for a chart, refused before the run where matplotlib is missing (else a long
    benchmark would end in an ImportError after its results)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(
            f"{text}: a chart needs matplotlib (pip install 'tqkv-compile[plot]'), or leave --plot out")
    return text
