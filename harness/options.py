"""Types of the command line's options (argparse ``type=``): each parses an option's text and checks its
domain, so a value outside it (``--factor nan``, ``--rounds 0``, ``--jobs 10**9``) is refused as the
command line is parsed, in one line naming the option and what was expected (exit code 2), before
anything is imported, loaded or checked out. Every numeric option of every command takes one of these."""

from __future__ import annotations

import argparse
import math
import re

#: The most processes or threads an option may ask for.
MAX_WORKERS = 4096
#: The largest seed ``compare`` takes (a 64-bit seed of numpy's generators).
MAX_SEED = 2**63 - 1
#: A device attnbench measures on.
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d{1,3})?)$")


def int_in(low: int, high: int):
    """The type of an integer option from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text[:40]!r}")
        return value

    return parse


def float_in(low: float, high: float, *, open_low: bool = False, open_high: bool = False):
    """The type of a finite number option from ``low`` to ``high`` (``open_low``/``open_high``: excluded)."""
    bounds = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = (low < value if open_low else low <= value) and (value < high if open_high else value <= high)
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"expected a finite number in {bounds}, got {text[:40]!r}")
        return value

    return parse


#: ``--factor``: how much slower a cell must be to be worse (a ratio >= 1; 1000: ten doublings short of anything).
factor = float_in(1, 1000)
#: ``--alpha``: the significance level of a bootstrap interval.
alpha = float_in(0, 1, open_low=True, open_high=True)
#: ``--seed``.
seed = int_in(0, MAX_SEED)
#: ``--jobs``: compiler processes.
jobs = int_in(1, MAX_WORKERS)
#: ``--rounds`` of regress and bisect.
rounds = int_in(1, 100)
#: ``--threads``: CPU threads, 0 for PyTorch's default.
threads = int_in(0, MAX_WORKERS)


def device(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not DEVICE_PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text[:40]!r}")
    return text


#: ``demo``'s shape and repeats: a small CPU input (DPFP needs d_key >= 2).
DEMO = {"batch": int_in(1, 64), "heads": int_in(1, 64), "seq_len": int_in(1, 8192), "d_key": int_in(2, 1024), "repeats": int_in(1, 1000)}
#: The most attention scores (batch · heads · seq_len²) of ``demo``'s input: 1 GiB of float32 in softmax's.
DEMO_SCORES = 2**28


def demo_error(batch: int, heads: int, seq_len: int) -> str | None:
    """What is wrong with ``demo``'s shape taken together (each option is in its domain), or None."""
    scores = batch * heads * seq_len**2
    if scores > DEMO_SCORES:
        return f"demo: --batch {batch} --heads {heads} --seq-len {seq_len} make {scores:,} attention scores, more than the {DEMO_SCORES:,} of a small CPU input"
    return None


class Parser(argparse.ArgumentParser):
    """argparse whose errors are as attnbench's others: one line, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")
