"""A task's command line generated from its config (``python -m harness.tasks.lm``, ``... .mt``):
one option per setting, with the setting's own default and description, so each default is
written once, in the config; every error one line, ``error: --option: why``, exit code 2."""

from __future__ import annotations

import argparse
import types
import typing

import yaml
from pydantic import BaseModel, ValidationError


class CommandLine(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, ``error: MESSAGE``, exit code 2."""

    def error(self, message):
        self.exit(2, f"error: {message}\n")


def command_line(config_class: type[BaseModel], *, prog: str, description: str, checkpoint_every: int | None) -> CommandLine:
    """The command line of a task: the run's options (``--variant``, ``--params``, ``--out``,
    ``--device``, ``--checkpoint-every``), then one option per field of ``config_class`` but
    ``name``: ``--field-name`` with the field's description and default; booleans as
    ``--x/--no-x``; a list or mapping as YAML or JSON text (a list also as ``a,b``); ``none``
    for None. An option left out does not appear in the parsed arguments, so the config's own
    default applies (``parse_command_line``)."""
    parser = CommandLine(prog=prog, description=description)
    parser.add_argument("--variant", required=True, help="attention variant (softmax, linear, performer, dpfp, delta, ...)")
    parser.add_argument("--params", default="{}", help="the variant's parameters as JSON or YAML, e.g. '{\"m\": 64}'")
    parser.add_argument("--out", required=True, help="directory for metrics.json and checkpoints/ (a rerun resumes from them)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK where CUDA is available, else cpu)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=checkpoint_every, help=f"steps between checkpoints in OUT/checkpoints (default: {_shown(checkpoint_every)})"
    )
    settings = parser.add_argument_group(f"settings (harness {config_class.__name__}; a scenario's task: section)")
    for name, field in config_class.model_fields.items():
        if name == "name":
            continue
        described = f"{field.description} " if field.description else ""
        help_text = f"{described}(default: {_shown(field.get_default())})".replace("%", "%%")
        option = "--" + name.replace("_", "-")
        if field.annotation is bool:
            settings.add_argument(option, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            settings.add_argument(option, default=argparse.SUPPRESS, help=help_text)
    return parser


def parse_command_line(parser: CommandLine, config_class: type[BaseModel], argv=None) -> tuple[argparse.Namespace, BaseModel]:
    """``(run arguments, config)`` of ``argv``: the run's options (``params`` as a dict) and the
    settings as a ``config_class``. Values the config refuses (a bad value, or settings that
    contradict each other) end the program with ``error: --option: why`` and exit code 2."""
    args = parser.parse_args(argv)
    try:
        params = yaml.safe_load(args.params)
    except yaml.YAMLError:
        params = None
    if not isinstance(params, dict):
        parser.error(f"--params: expected a mapping in JSON or YAML such as '{{\"m\": 64}}', got {args.params!r}")
    given = {name: getattr(args, name) for name in config_class.model_fields if name != "name" and hasattr(args, name)}
    try:
        values = {name: _option_value(text, config_class.model_fields[name].annotation, name) for name, text in given.items()}
        config = config_class.model_validate(values, strict=False)  # an option's text becomes a number here
    except OptionError as exc:
        parser.error(str(exc))
    except ValidationError as exc:
        parser.error("; ".join(_option_error(error) for error in exc.errors()))
    for name in given:
        delattr(args, name)
    args.params = params
    return args, config


class OptionError(ValueError):
    """An option whose text is not a value of its setting's type."""


def _option_value(value, annotation, name: str):
    """The setting of an option's text: None for ``none``/``null`` where None is allowed, YAML for
    lists and mappings (a list also as ``a,b,c``), the text itself otherwise (pydantic converts
    numbers)."""
    if not isinstance(value, str):
        return value
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else (annotation,)
    if type(None) in kinds and value.strip().lower() in ("none", "null"):
        return None
    origins = {typing.get_origin(kind) or kind for kind in kinds}
    if not origins & {list, dict}:
        return value
    try:
        parsed = yaml.safe_load(value)
        if list in origins and not isinstance(parsed, list):
            parsed = [yaml.safe_load(item) for item in value.split(",")]
    except yaml.YAMLError as exc:
        raise OptionError(f"--{name.replace('_', '-')}: not valid YAML or JSON ({' '.join(str(exc).split())})") from None
    return parsed


def _option_error(error: dict) -> str:
    """One pydantic error as ``--option: message, got value``."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    option = "--" + str(error["loc"][0]).replace("_", "-")
    return f"{option}: {message}" + ("" if error["input"] is None else f", got {error['input']!r}")


def _shown(value) -> str:
    return "none" if value is None else str(value)
