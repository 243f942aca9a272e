"""``attnbench kit``: the pip command lines it builds, the requirements it takes from the attnbench
wheel (its extras, without torch and triton), its one-line errors, and (slow, needs PyPI) a real kit
for Python 3.12."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
from helpers import attnbench, attnbench_here, needs_shared

from harness.gpu import kit
from harness.gpu.kit import KitError

METADATA = """Metadata-Version: 2.1
Name: attnbench
Version: 0.1.0
Requires-Dist: torch>=2.4
Requires-Dist: pydantic<3,>=2.5
Requires-Dist: triton>=3.0; extra == "triton"
Requires-Dist: pytest>=8; extra == "test"
Requires-Dist: fla-core>=0.6; extra == "fla"
Requires-Dist: ray>=2.9; extra == "ray"
"""


def fake_wheel(directory: Path, metadata: str = METADATA) -> Path:
    wheel = directory / "attnbench-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("attnbench-0.1.0.dist-info/METADATA", metadata)
    return wheel


def test_requirements_are_the_extras_without_torch_and_triton(tmp_path):
    wheel = fake_wheel(tmp_path)
    assert kit.requirements_of(wheel) == ["pydantic<3,>=2.5", "pytest>=8", "fla-core>=0.6"]
    assert kit.requirements_of(wheel, extras=("ray",)) == ["pydantic<3,>=2.5", "ray>=2.9"]


def test_a_marker_it_cannot_read_is_an_error(tmp_path):
    wheel = fake_wheel(tmp_path, METADATA + 'Requires-Dist: tomli; python_version < "3.11"\n')
    with pytest.raises(KitError, match="tomli.*a marker the kit does not read"):
        kit.requirements_of(wheel)


def test_the_pip_command_lines(tmp_path):
    download = kit.pip_download_command(["pydantic<3,>=2.5", "pytest>=8"], tmp_path, "3.12", ["manylinux_2_28_x86_64", "manylinux2014_x86_64"])
    assert download[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--only-binary=:all:" in download
    assert download[download.index("--python-version") + 1] == "3.12"
    assert [download[i + 1] for i, arg in enumerate(download) if arg == "--platform"] == ["manylinux_2_28_x86_64", "manylinux2014_x86_64"]
    assert download[download.index("--dest") + 1] == str(tmp_path)
    assert download[-2:] == ["pydantic<3,>=2.5", "pytest>=8"]
    wheel = kit.pip_wheel_command(Path("/repo"), tmp_path)
    assert wheel[3:] == ["wheel", "--no-deps", "--wheel-dir", str(tmp_path), "/repo"]


def test_a_bad_python_version_is_one_line(tmp_path):
    done = attnbench_here("kit", str(tmp_path / "kit"), "--python", "py312")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: kit: --python: expected a Python version such as 3.12, got 'py312'"


def test_missing_data_says_where_it_looked(tmp_path):
    done = attnbench_here("kit", str(tmp_path / "kit"), env={"ATTNBENCH_DATA": str(tmp_path / "nothing")})
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: kit: the data of gpu-check's LM cell is not on this machine: wikitext-2: ")
    assert str(tmp_path / "nothing" / "wikitext-2") in line and "wiki.train.tokens" in line
    assert not (tmp_path / "kit").exists()


@needs_shared
def test_without_the_index_it_says_pip_could_not_reach_it(tmp_path):
    done = attnbench_here("kit", str(tmp_path / "kit"), env={"PIP_INDEX_URL": "http://127.0.0.1:9/simple/"})  # port 9: nothing listens
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: kit: pip could not reach the package index http://127.0.0.1:9/simple/ (")
    assert line.endswith("or name a reachable mirror in PIP_INDEX_URL")
    assert not (tmp_path / "kit" / "wheels").exists()


@pytest.mark.slow
@needs_shared
def test_a_kit_for_python_3_12(tmp_path):
    try:
        kit.check_index()
    except KitError as exc:
        pytest.skip(f"pip's package index cannot be reached from this machine: {exc}")
    done = attnbench("kit", str(tmp_path / "kit"), "--python", "3.12")
    assert done.returncode == 0, done.stderr
    wheels = sorted(path.name for path in (tmp_path / "kit" / "wheels").glob("*.whl"))
    assert any(name.startswith("attnbench-") for name in wheels)
    assert any(name.startswith("pydantic_core-") and "-cp312-cp312-" in name for name in wheels)
    assert any(name.startswith("fla_core-") for name in wheels) and any(name.startswith("pytest-") for name in wheels)
    assert not [name for name in wheels if name.startswith(("torch-", "triton-", "nvidia_cu"))]  # torch brings the CUDA libraries
    data = tmp_path / "kit" / "data" / "wikitext-2"
    assert sorted(path.name for path in data.iterdir()) == ["wiki.test.tokens", "wiki.train.tokens", "wiki.valid.tokens"]
    readme = (tmp_path / "kit" / "README.txt").read_text()
    assert """python3.12 -m pip install --no-index --find-links "$KIT/wheels" 'attnbench[test,fla]'""" in readme
    assert 'export ATTNBENCH_DATA="$KIT/data"' in readme
