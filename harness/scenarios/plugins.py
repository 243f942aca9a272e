"""Plugins: modules that register extra variants (``variants.register``) or tasks
(``harness.tasks.register``) when imported, named with ``--plugin`` or ``$ATTNBENCH_PLUGINS``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from pathlib import Path

from ..common.formatting import one_line

#: A plugin file is imported as this prefix and its stem, so ``variants.py`` or ``json.py`` cannot replace those modules.
MODULE_PREFIX = "attnbench_plugin_"


class PluginError(Exception):
    """A plugin that cannot be imported: the message names the plugin (and the line that failed)."""


def module_name(plugin_file: str) -> str:
    """The private module name a plugin file is imported under."""
    return MODULE_PREFIX + re.sub(r"\W", "_", Path(plugin_file).stem)


def load_plugins(plugins) -> None:
    """Import modules (names or .py paths) that register extra variants or tasks."""
    for plugin in plugins:
        try:
            _load(plugin)
        except PluginError:
            raise
        except (Exception, SystemExit) as exc:  # a plugin's sys.exit() ends no command, nor with its exit code
            raise PluginError(f"plugin {one_line(plugin)}{_failed_line(plugin, exc)}: {type(exc).__name__}: {exc}") from exc


def _load(plugin: str) -> None:
    if not plugin.endswith(".py"):
        importlib.import_module(plugin)
        return
    if not Path(plugin).is_file():
        raise PluginError(f"plugin {one_line(plugin)}: no such file")
    spec = importlib.util.spec_from_file_location(module_name(plugin), plugin)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {one_line(plugin)}: cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise


def _failed_line(plugin: str, exc: BaseException) -> str:
    """``, line N`` of the plugin file where ``exc`` was raised (a SyntaxError's own line), if there."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f", line {exc.lineno}"
    inside = [frame for frame in traceback.extract_tb(exc.__traceback__) if Path(frame.filename).resolve() == Path(plugin).resolve()]
    return f", line {inside[-1].lineno}" if inside else ""


def plugin_variants() -> list[str]:
    """One line per variant a plugin registered (not a shipped one): its name, the file it came from and its
    parameters, each with what it accepts (``PARAMS``) or, a constructor keyword not declared there, that
    it is not checked before a run."""
    registry = sys.modules.get("variants.base")
    if registry is None:  # no plugin imported the variants: only the shipped ones exist
        return []
    from variants import params

    lines = []
    for name in registry.names():
        if name in params.SHIPPED:
            continue
        factory = registry.registered(name)
        module = sys.modules.get(factory.__module__)
        origin = getattr(module, "__file__", None) or factory.__module__
        lines.append(f"{name} (from {origin}): parameters: {_parameters(factory)}")
    return lines


def _parameters(factory) -> str:
    """``chunk_size (a positive int), scale (not declared in PARAMS: unchecked)``, or ``none``."""
    from variants import params

    declared = params.declared(factory)
    fixed = set(getattr(factory, "fixed_params", ()))
    keywords = [
        name
        for name, parameter in inspect.signature(factory).parameters.items()
        if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD) and name != "d_key"
    ]
    shown = [f"{name} ({spec.rules[0][1] if spec.rules else 'any value'})" for name, spec in declared.items() if name not in fixed]
    shown += [f"{name} (not declared in PARAMS: unchecked)" for name in keywords if name not in declared and name not in fixed]
    return ", ".join(shown) or "none"
