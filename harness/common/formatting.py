"""How numbers are written in tables and reports (times with units, ratios, SI suffixes, sizes) and how errors quote values."""

from __future__ import annotations

import json
import math

MIB = 2**20


def present(value) -> bool:
    """False for None and NaN (the holes pandas leaves when flattening dicts), else True."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def format_seconds(value) -> str:
    """A time with its unit: ``812 µs``, ``20.3 ms``, ``1.25 s``; ``-`` for a missing value."""
    if not present(value):
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def format_ratio(value) -> str:
    return "-" if not present(value) else f"{value:.3f}"


def text(value) -> str:
    """A table entry: ``-`` for a missing value, floats to four significant digits."""
    if not present(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def si(value) -> str:
    """``214k``, ``1.23M``: three significant digits with a k/M/G suffix."""
    if not present(value):
        return "-"
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def mib(value) -> str:
    return "-" if not present(value) else f"{value / MIB:.1f} MiB"


def gib(value) -> str:
    return "-" if not present(value) else f"{value / 2**30:.1f} GiB"


def percent(value) -> str:
    """``±4.2%`` of a relative half-width; ``-`` for a missing value."""
    return "-" if not present(value) else f"±{100 * value:.2g}%"


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``1 step``, ``2 steps``, ``0 series`` (``plural``: the noun's plural where it is not noun + s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def fraction(value) -> str:
    """A fraction of a limit: ``0.031``; ``-`` for a missing value."""
    return "-" if not present(value) else f"{value:.3g}"


def relative_error(value) -> str:
    """A relative error: ``1.2e-07``; ``-`` for a missing value."""
    return "-" if not present(value) else f"{value:.1e}"


def flag(value) -> str:
    """``unstable`` for a true flag, empty for false, ``-`` when unknown."""
    return "-" if not present(value) else "unstable" if value else ""


#: The most characters of a value an error message quotes.
QUOTE_CHARS = 200


def quote(value) -> str:
    """A value as an error message shows it: its JSON (or repr) cut to ``QUOTE_CHARS``
    characters, with the full length said, so a huge wrong value gives a short message."""
    try:
        shown = json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        shown = repr(value)
    if len(shown) <= QUOTE_CHARS:
        return shown
    return f"{shown[:QUOTE_CHARS]}... ({len(shown)} characters)"


def one_line(text: str) -> str:
    """A user's ``text`` (a name, a range) as a one-line message shows it: as it is, or quoted where it holds a newline
    or another unprintable character."""
    return text if text.isprintable() else quote(text)


#: The first characters that make a spreadsheet read a cell as a formula (OWASP, "CSV Injection").
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value):
    """A CSV cell as a spreadsheet shows it and never evaluates: text beginning with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return gets a leading ``'`` (OWASP's advice); anything else,
    numbers (negative ones too) included, as it is."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value
