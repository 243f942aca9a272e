"""Plugins: modules that register extra variants (``variants.register``) or tasks
(``harness.tasks.register``) when imported, named with ``--plugin`` or ``$ATTNBENCH_PLUGINS``."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_plugins(plugins) -> None:
    """Import modules (names or .py paths) that register extra variants or tasks."""
    for plugin in plugins:
        if plugin.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(plugin).stem, plugin)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load plugin file {plugin}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            importlib.import_module(plugin)
