"""Every cell id of every shipped scenario × preset stays as it was (users' results files keep
resuming and comparing): the ids of each expansion, in order, against ``cell_ids.json``. A
scenario or preset added later is not pinned; one whose cells change on purpose is re-pinned,
with the change said in docs, by ``python tests/test_harness/test_cell_ids.py`` (rewrites the file)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import yaml

from harness.scenarios.scenario import load_scenario, resolve_path, shipped

PINNED = Path(__file__).with_name("cell_ids.json")


def expansions() -> dict[str, str]:
    """``{"scenario:preset": "<cell count> <sha256 of the ids in order>"}`` of every shipped scenario and preset (None: no preset)."""
    found = {}
    for name in shipped():
        presets = yaml.safe_load(resolve_path(name).read_text()).get("presets") or {}
        for preset in [None, *sorted(presets)]:
            ids = [cell.cell_id for cell in load_scenario(name, preset=preset).cells()]
            found[f"{name}:{preset}"] = f"{len(ids)} {hashlib.sha256(' '.join(ids).encode()).hexdigest()[:16]}"
    return found


@pytest.mark.slow
def test_shipped_cell_ids_stay_as_they_were():
    pinned, now = json.loads(PINNED.read_text()), expansions()
    changed = {key: (value, now.get(key, "gone")) for key, value in pinned.items() if now.get(key) != value}
    assert not changed, f"cell ids changed (pinned, now): {changed}"


if __name__ == "__main__":
    PINNED.write_text(json.dumps(expansions(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
