"""Files written so that a reader never sees half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as JSON to ``path``: into a temporary file in the same directory, flushed
    to disk (fsync), then renamed over ``path`` (``os.replace``), so ``path`` holds either its
    old content or the whole new one, even if the process dies midway."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(obj, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
