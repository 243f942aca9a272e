"""What does not validate, in the user's words: pydantic's errors of a scenario (``harness.scenarios.schema``)
as one line per field, ``field: what it expects, got value``, with "did you mean" for a misspelled field or
choice, the members of a union joined ('an integer or a list of them'), the ``--set`` that gave a field named."""

from __future__ import annotations

import re

from pydantic import BaseModel, ValidationError

from variants.errors import did_you_mean

from ..common.formatting import quote
from .scenario_files import TASK, set_target

#: A union member as pydantic names it in an error's location (``int``; ``list[int]``): one of it, several.
_MEMBERS = {"int": ("an integer", "integers"), "float": ("a number", "numbers"), "str": ("a string", "strings"), "bool": ("true or false", "booleans")}
#: pydantic's error types in words: what the field expects.
_EXPECTED = {
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_type", "float_parsing", "finite_number"), "a number"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "a mapping"),
    "string_type": "a string",
    "list_type": "a list",
}
#: pydantic's bounds in words, by error type: the key of the bound in the error's ``ctx``, its words.
_BOUNDS = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "more than"), "less_than_equal": ("le", "at most"), "less_than": ("lt", "below")}


def _member(part) -> str | None:
    """What a union member named in an error's location expects ('an integer', 'a list of integers'); None for a field name."""
    listed = re.fullmatch(r"list\[(\w+)\]", part) if isinstance(part, str) else None
    if listed and listed[1] in _MEMBERS:
        return f"a list of {_MEMBERS[listed[1]][1]}"
    return _MEMBERS[part][0] if isinstance(part, str) and part in _MEMBERS else None


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """The field names of the section of ``model`` at ``path`` (its dotted names), [] where that is not a model."""
    for part in path:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        members = [field.annotation, *getattr(field.annotation, "__args__", ())]
        model = next((member for member in members if isinstance(member, type) and issubclass(member, BaseModel)), None)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _expects(error: dict, model: type[BaseModel] | None) -> str:
    """What one pydantic error says its field expects, in words ('expected an integer'), or its own message."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}"
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        return f"expected {words} {ctx[key]}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", ctx["expected"])
        return f"expected {ctx['expected']}{did_you_mean(error.get('input'), choices)}"
    if kind == "extra_forbidden":
        known = _fields_at(model, error["loc"][:-1]) if model else []
        fields = f"; the fields here: {', '.join(known)}" if known else ""
        return f"not a field (got {quote(error.get('input'))}){did_you_mean(error['loc'][-1], known)}{fields}"
    if kind == "union_tag_invalid":  # the task section's name (the tag that picks its config)
        tags = re.findall(r"'([^']*)'", ctx["expected_tags"])
        field = ".".join(map(str, (*error["loc"], ctx["discriminator"].strip("'"))))
        return f"{field}: expected one of {ctx['expected_tags']}, got {quote(ctx['tag'])}{did_you_mean(ctx['tag'], tags)}"
    if kind == "missing":
        return "required, not given"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length', 1)} value(s)"
    return error["msg"].removeprefix("Value error, ")


def plain_errors(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One line per field ``exc`` refuses, ``field: what it expects, got value``, in words, in the order pydantic
    found them; the errors of a union's members (``axes.seq_len.int``, ``axes.seq_len.list[int]``) are one line of
    their field ('expected an integer or a list of them'). ``model``: the model validated (for an unknown field, its fields)."""
    fields: dict[tuple, list[tuple[str | None, dict]]] = {}
    for error in exc.errors():
        loc = error["loc"]
        if loc[:1] == (TASK,) and len(loc) > 2:  # task.<name>.field: the name is pydantic's tag of the task's config
            loc = (TASK, *loc[2:])
        cut = next((i for i, part in enumerate(loc) if _member(part)), len(loc))
        fields.setdefault(tuple(loc[:cut]), []).append((_member(loc[cut]) if cut < len(loc) else None, error))
    lines = []
    for loc, errors in fields.items():
        field, (_, first) = ".".join(str(part) for part in loc), errors[0]
        members = [member for member, _ in errors]
        if len(errors) > 1 and all(members):
            message = "expected " + " or ".join(dict.fromkeys(members))
            for one, several in _MEMBERS.values():
                message = message.replace(f"{one} or a list of {several}", f"{one} or a list of them")
        else:
            message = _expects(errors[-1][1], model)
        if re.match(rf"^{re.escape(field)}[\w.\[\]]*: ", message):  # a check that names its field itself
            lines.append(message)
            continue
        value = first.get("input")
        shown = quote(value) if not isinstance(value, dict) else "{...}"
        got = "" if "got " in message or first["type"] == "missing" else f", got {shown}"
        lines.append(f"{field or '(top level)'}: {message}{got}")
    return lines


def format_validation(path: str, exc: ValidationError, overrides=(), model: type[BaseModel] | None = None) -> str:
    """What is wrong with a scenario that does not validate, one line per field (``plain_errors``): ``path: field: ...``
    for one, else ``path: invalid scenario`` above them; a field that a ``--set`` of ``overrides`` gave says so
    (``axes.seq_len: expected an integer or a list of them, got 'abc' (from --set seq_len=abc)``)."""
    lines = []
    targets = [(".".join(set_target(assignment)), assignment) for assignment in overrides]
    for line in plain_errors(exc, model):
        field = line.partition(": ")[0]
        given = [assignment for target, assignment in targets if field == target or field.startswith((target + ".", target + "["))]
        lines.append(f"{line} (from --set {given[-1]})" if given else line)
    return f"{path}: {lines[0]}" if len(lines) == 1 else "\n  ".join([f"{path}: invalid scenario", *lines])
