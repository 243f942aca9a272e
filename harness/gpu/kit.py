"""``attnbench kit DIR``: what an offline GPU machine needs to run ``attnbench gpu-check``, gathered on a
machine with internet.

``DIR/wheels``: the attnbench wheel (``pip wheel --no-deps`` of this checkout) and, for the target's
Python and platforms, every wheel attnbench and its extras (default ``test`` and ``fla``) need
(``pip download --only-binary=:all:``), except torch and triton: the GPU machine's own are used.
``DIR/data``: the data sets of gpu-check's quality cells (``gpu_check.quality_data``).
``DIR/README.txt``: the lines that install and use the kit there. Errors are ``KitError``, one line.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

#: A Linux x86-64 machine with glibc 2.28 or newer (pip matches each tag exactly, so the list names
#: the tags wheels are published under; manylinux2014 also accepts manylinux2010 and manylinux1).
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEFAULT_EXTRAS = ("test", "fla")
#: Installed on the GPU machine already, in the build that matches its driver.
EXCLUDED = ("torch", "triton")
INDEX_TIMEOUT_S = 15
_REQUIREMENT = re.compile(r"^(?P<spec>(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)[^;]*?)\s*(?:;\s*extra\s*==\s*[\"'](?P<extra>[\w.-]+)[\"']\s*)?$")


class KitError(RuntimeError):
    """A kit that cannot be made; the message (one line) says why and what to do."""


def project_root() -> Path:
    """The checkout attnbench runs from (its pyproject.toml builds the attnbench wheel)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise KitError(f"kit: the attnbench wheel is built from a checkout, and {root} has no pyproject.toml; run attnbench kit from a checkout")
    return root


def pip_wheel_command(root: Path, wheels: Path) -> list[str]:
    """Build the attnbench wheel alone into ``wheels``."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), str(root)]


def pip_download_command(requirements: list[str], wheels: Path, python: str, platforms) -> list[str]:
    """Download ``requirements`` and everything they need, as wheels for ``python`` on ``platforms``."""
    targets = [arg for platform in platforms for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", python, *targets, "--dest", str(wheels), *requirements]


def requirements_of(wheel: Path, extras=DEFAULT_EXTRAS) -> list[str]:
    """The requirements in ``wheel``'s metadata, with those of ``extras``, without ``EXCLUDED``."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next((name for name in archive.namelist() if name.endswith(".dist-info/METADATA")), None)
        if metadata is None:
            raise KitError(f"kit: {wheel} has no .dist-info/METADATA")
        message = importlib.metadata.PathDistribution(zipfile.Path(archive, str(Path(metadata).parent) + "/"))
        requires = message.requires or []
    chosen = []
    for line in requires:
        match = _REQUIREMENT.match(line.strip())
        if match is None:
            raise KitError(f"kit: {wheel}: requirement {line!r} has a marker the kit does not read (only extra == NAME)")
        if match["extra"] not in (None, *extras) or match["name"].lower() in EXCLUDED:
            continue
        chosen.append(match["spec"])
    return chosen


def index_url() -> str:
    """The index pip downloads from: $PIP_INDEX_URL, else pip's configured ``index-url``, else pip's default."""
    if url := os.environ.get("PIP_INDEX_URL"):
        return url
    configured = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True)
    if configured.returncode == 0 and configured.stdout.strip():
        return configured.stdout.strip()
    # pip's own default, asked in a child: importing pip's internals here would import the standard
    # library's distutils, which setuptools (torch.compile's C++ builds) then refuses in this process
    default = subprocess.run(
        [sys.executable, "-c", "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"], capture_output=True, text=True, check=True
    )
    return default.stdout.strip()


def check_index() -> None:
    """A KitError unless the package index pip uses (``index_url``) answers."""
    url = index_url()
    try:
        with urllib.request.urlopen(url, timeout=INDEX_TIMEOUT_S):
            pass
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts; ValueError: not a URL
        raise KitError(
            f"kit: pip could not reach the package index {url} ({getattr(exc, 'reason', exc)}); "
            "make the kit on a machine with internet, or name a reachable mirror in PIP_INDEX_URL"
        ) from None


def _pip(command: list[str], what: str) -> None:
    """Run pip, its progress on stdout; a KitError of one line (pip's last) if it fails."""
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = next((line.strip() for line in reversed(done.stderr.splitlines()) if line.strip()), "no message")
        raise KitError(f"kit: pip failed to {what} (exit code {done.returncode}): {last}")


def gather(out: Path, python: str = "3.12", platforms=DEFAULT_PLATFORMS, extras=DEFAULT_EXTRAS) -> Path:
    """Make the kit in ``out``; returns its README.txt."""
    from ..tasks.download import LAYOUTS, DataError
    from .gpu_check import quality_data

    if not re.fullmatch(r"3\.\d+", python):
        raise KitError(f"kit: --python: expected a Python version such as 3.12, got {python!r}")
    try:
        data = quality_data()
    except DataError as exc:
        raise KitError(f"kit: the data of gpu-check's LM cell is not on this machine: {exc}") from None
    root = project_root()
    check_index()
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for stale in wheels.glob("attnbench-*.whl"):
        stale.unlink()
    _pip(pip_wheel_command(root, wheels), "build the attnbench wheel")
    wheel = next(wheels.glob("attnbench-*.whl"))
    _pip(pip_download_command(requirements_of(wheel, extras), wheels, python, platforms), f"download the wheels for Python {python}")
    for name, directory in data.items():
        target = out / "data" / name
        target.mkdir(parents=True, exist_ok=True)
        for file in LAYOUTS[name]:
            shutil.copy2(directory / file, target / file)
    readme = out / "README.txt"
    readme.write_text(instructions(python, platforms, extras, sorted(data), wheel.name))
    return readme


def instructions(python: str, platforms, extras, data_sets: list[str], wheel: str) -> str:
    """README.txt: what the kit holds and the lines that install and use it on the offline machine."""
    made = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from .gpu_check import installed_version

    version = installed_version("attnbench")
    return f"""attnbench kit for an offline GPU machine ({made}, attnbench {version}, {wheel})

wheels/  attnbench and the wheels attnbench[{",".join(extras)}] needs for Python {python} on
         {", ".join(platforms)}; not torch or triton: the machine's own are used
         (a CUDA build of torch, and the triton it pins).
data/    {", ".join(data_sets)}: the data of gpu-check's LM cell.

Carry this directory and a checkout of attnbench at the same commit (gpu-check runs the kernel
tests in its tests/test_kernels) to the GPU machine. There, with KIT the path of this directory
and CHECKOUT the path of the checkout:

  python{python} -m pip install --no-index --find-links "$KIT/wheels" 'attnbench[{",".join(extras)}]'
  export ATTNBENCH_DATA="$KIT/data"
  cd "$CHECKOUT" && attnbench gpu-check

gpu-check first says in one line each what it still lacks (exit code 2). Without the checkout,
`attnbench gpu-check --no-kernel-tests` runs the rest.
"""
