"""Option value types for argparse: every value is checked while the command line is parsed, before
anything is loaded, and a bad one ends as argparse's error naming the option (one line, exit 2).

Each function takes the option's text and returns the value, or raises ArgumentTypeError saying what
the value must be."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from moestream.engine.sampling import PENALTY_MAX, REPETITION_MAX, SEED_MAX
from moestream.hub import PREFIX as HF_PREFIX
from moestream.hub import HubModel, parse_spec

Bad = argparse.ArgumentTypeError

INT_MAX = 2**31 - 1  # counts beyond this are typos, and C code below takes 32-bit ints
MB_MAX = 2**30  # a petabyte, in MB: more than any machine has


def whole(lo: int, hi: int = INT_MAX) -> Callable[[str], int]:
    """A whole number in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise Bad(f"must be a whole number, got {text!r}") from None
        if value < lo:
            raise Bad(f"must be a positive number, got {value}" if lo == 1 else f"must be at least {lo}, got {value}")
        if value > hi:
            raise Bad(f"must be at most {hi}, got {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def real(lo: float, hi: float = math.inf, *, above: bool = False) -> Callable[[str], float]:
    """A finite number >= lo (> lo with above=True) and <= hi."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise Bad(f"must be a number, got {text!r}") from None
        low_ok = value > lo if above else value >= lo
        if not math.isfinite(value) or not low_ok or value > hi:
            rel = ">" if above else ">="
            span = f"{rel} {lo:g}" + (f" and <= {hi:g}" if math.isfinite(hi) else "")
            raise Bad(f"must be a finite number {span}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


positive = whole(1)
count = whole(0)
threads = whole(1, 1024)
io_threads = whole(1, 256)
megabytes = whole(1, MB_MAX)
SIZE_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}  # gguf-split's: powers of 1000
SIZE_MAX = 1 << 50


def byte_size(text: str) -> int:
    """Bytes as gguf-split's --split-max-size writes them: a whole number, optionally K, M or G (x1000)."""
    t = text.strip().upper()
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    digits = t[: len(t) - len(unit)]
    if not digits.isdigit() or not digits.isascii():
        raise Bad(f"must be a size like 2G, 500M or 100K (K/M/G: x1000), got {text!r}")
    value = int(digits) * SIZE_UNITS[unit]
    if not 0 < value <= SIZE_MAX:
        raise Bad(f"must be between 1 byte and {SIZE_MAX // 1000**4}T, got {text!r}")
    return value


port = whole(0, 65535)
seed = whole(0, SEED_MAX)


def temperature(text: str) -> float:
    try:
        return real(0.0)(text)
    except Bad:
        raise Bad(f"must be a finite number >= 0 (0 = greedy), got {text!r}") from None


def top_p(text: str) -> float:
    try:
        return real(0.0, 1.0, above=True)(text)
    except Bad:
        raise Bad(f"must be a number greater than 0 and at most 1 (1 = off), got {text!r}") from None


def min_p(text: str) -> float:
    try:
        return real(0.0, 1.0)(text)
    except Bad:
        raise Bad(f"must be a number between 0 and 1 (0 = off), got {text!r}") from None


def penalty(text: str) -> float:
    """presence and frequency penalties, in OpenAI's range."""
    try:
        return real(-PENALTY_MAX, PENALTY_MAX)(text)
    except Bad:
        raise Bad(f"must be a number between -{PENALTY_MAX:g} and {PENALTY_MAX:g} (0 = off), got {text!r}") from None


def repeat_penalty(text: str) -> float:
    try:
        return real(0.0, REPETITION_MAX, above=True)(text)
    except Bad:
        raise Bad(f"must be a number > 0 and <= {REPETITION_MAX:g} (1 = off), got {text!r}") from None


def top_k(text: str) -> int:
    try:
        return whole(0)(text)
    except Bad:
        raise Bad(f"must be a whole number >= 0 (0 = off), got {text!r}") from None


def text(value: str) -> str:
    """Text from the command line; bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Bad("the text is not valid UTF-8; pass it in UTF-8") from None
    return value


def input_file(path: str) -> str:
    """A file that exists and can be read."""
    if not os.path.exists(path):
        raise Bad(f"{path}: not found")
    if os.path.isdir(path):
        raise Bad(f"{path} is a directory; give a file")
    if not os.access(path, os.R_OK):
        raise Bad(f"{path} is not readable (permission denied)")
    return path


def model_path(path: str) -> str:
    """A model: a GGUF file, any part of a split model, a directory holding one (GGUFModel checks the rest), or
    hf:OWNER/NAME[:QUANT], a model on the Hugging Face Hub (a local file named so: ./hf:...)."""
    if path.startswith(HF_PREFIX):
        try:
            return HubModel(str(parse_spec(path)))
        except ValueError as exc:
            raise Bad(str(exc)) from None
    if not os.path.exists(path):
        raise Bad(f"{path}: not found")
    if not os.access(path, os.R_OK):
        raise Bad(f"{path} is not readable (permission denied)")
    return path


def directory(path: str) -> str:
    if not os.path.isdir(path):
        raise Bad(f"{path} is not a directory")
    return path


def output_file(path: str) -> str:
    """A file that can be written: its directory exists, and it is not a directory itself."""
    if not path:
        raise Bad("needs a file name")
    check_writable(path)
    return path


def check_writable(path: str) -> None:
    if os.path.isdir(path):
        raise Bad(f"{path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise Bad(f"the directory {parent} does not exist; create it first")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise Bad(f"{path} is not writable (permission denied)")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        raise Bad(f"cannot create files in {parent} (permission denied)")
