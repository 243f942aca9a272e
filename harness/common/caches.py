"""Caches are data that may be wrong (docs/results.md, "Caches"): a cache is read through a pydantic
model, and one that does not validate (non-finite numbers, another shape or version, another key)
is ignored with one warning line naming it, so that its owner rebuilds it."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError


def first_error(exc: ValidationError) -> str:
    """``field.path: message`` of the first error of ``exc`` (the field empty for the whole document)."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def ignored(path: Path, reason: str) -> None:
    """The one warning line of a cache that is not used."""
    print(f"warning: ignoring the cache {path} ({reason}); it is rebuilt", file=sys.stderr)


def validated(path: Path, model: type[BaseModel], data, *, json: bool = False) -> BaseModel | None:
    """``data`` (a JSON text when ``json``) as ``model``, or None after the warning of ``ignored``."""
    try:
        return model.model_validate_json(data) if json else model.model_validate(data)
    except ValidationError as exc:
        ignored(path, first_error(exc)[:200])
        return None
