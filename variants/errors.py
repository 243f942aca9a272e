"""The errors of the variant library (``variants.VariantError``, ``variants.UnsupportedBackend``) and the
"did you mean" of their messages (the harness's too)."""

from __future__ import annotations

import difflib


class VariantError(ValueError):
    """Bad input to a variant: an unknown name, a wrong shape, a parameter out of range."""


class UnsupportedBackend(VariantError):
    """A known backend that this variant (or this configuration of it) has no implementation for."""


def did_you_mean(word: str, known) -> str:
    """`` (did you mean 'x'?)`` naming the closest of ``known`` to a mistyped ``word`` (difflib), or ''."""
    close = difflib.get_close_matches(str(word), [str(name) for name in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
