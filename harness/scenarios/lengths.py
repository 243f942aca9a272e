"""The sequence lengths of a packed batch (``axes.lengths``): an explicit list, or lengths drawn
from a named distribution until a token budget is filled.

A distribution is a mapping with a ``kind``:

* ``{kind: list, values: [37, 512, 64]}``: those lengths, in that order;
* ``{kind: uniform, low: 16, high: 1024, tokens: 8192, seed: 0}``: integers uniform on [low, high];
* ``{kind: lognormal, median: 256, sigma: 1.0, tokens: 8192, seed: 0, max: 4096}``: round(exp(N(ln median, σ²)))
  clipped to [1, max] (default: the token budget);
* ``{kind: histogram, file: lengths.csv, tokens: 8192, seed: 0}``: lengths drawn with the frequencies of a
  captured histogram, a text file (path relative to the scenario, under its folder or ``$ATTNBENCH_DATA``) of lines
  ``length,count`` (``#`` comments), at most ``MAX_HISTOGRAM_BYTES``.

A drawn batch takes lengths until they reach ``tokens``; the last is cut so that the batch holds
exactly ``tokens`` tokens (every distribution of a scenario then has the same work in real tokens).
The draw is Python's ``random.Random(seed)``: the same lengths on every machine.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

from ..common.files import read_small
from ..common.formatting import quote
from ..tasks.download import DATA_ENV

#: The fields each kind takes (besides ``kind``), and which are required.
FIELDS = {
    "list": ({"values"}, {"values"}),
    "uniform": ({"low", "high", "tokens", "seed"}, {"low", "high", "tokens"}),
    "lognormal": ({"median", "sigma", "tokens", "seed", "max"}, {"median", "sigma", "tokens"}),
    "histogram": ({"file", "tokens", "seed", "max"}, {"file", "tokens"}),
}
#: The most sequences, and tokens, one batch may hold.
MAX_SEQUENCES = 1 << 16
MAX_TOKENS = 1 << 31
#: The largest captured histogram file read.
MAX_HISTOGRAM_BYTES = 1 << 20


@dataclass(frozen=True)
class Batch:
    """A packed batch: its ``lengths`` and ``label``, the cell's ``axes.lengths`` (which names the
    distribution, its parameters, token budget and seed, and a histogram file's content hash)."""

    lengths: tuple[int, ...]
    label: str

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def parse(value, field: str, base: Path | None) -> list[Batch]:
    """The batches of ``axes.lengths`` (one distribution or a list of them, swept); a ValueError naming
    ``field`` (``axes.lengths[1].high``) and what was expected. ``base``: the scenario's folder (histogram files)."""
    specs = value if isinstance(value, list) else [value]
    if not specs:
        raise ValueError(f"{field}: expected a distribution or a list of them, got an empty list")
    return [_batch(spec, f"{field}[{index}]" if isinstance(value, list) else field, base) for index, spec in enumerate(specs)]


def _batch(spec, field: str, base: Path | None) -> Batch:
    if not isinstance(spec, dict) or spec.get("kind") not in FIELDS:
        kind = spec.get("kind") if isinstance(spec, dict) else spec
        raise ValueError(f"{field}: expected a mapping with kind: {', '.join(FIELDS)} (see README, Scenario format), got {quote(kind)}")
    kind = spec["kind"]
    allowed, required = FIELDS[kind]
    extra = sorted(set(spec) - allowed - {"kind"})
    if extra:
        raise ValueError(f"{field}.{extra[0]}: not a field of kind {kind} (its fields: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(spec))
    if missing:
        raise ValueError(f"{field}.{missing[0]}: required for kind {kind}")
    if kind == "list":
        values = spec["values"]
        if not isinstance(values, list) or not values or not all(_positive(item) for item in values) or len(values) > MAX_SEQUENCES:
            raise ValueError(f"{field}.values: expected a list of 1 to {MAX_SEQUENCES} positive integers, got {quote(values)}")
        return Batch(tuple(values), "[" + ",".join(map(str, values)) + "]")
    tokens, seed = _integer(spec, "tokens", field, 1, MAX_TOKENS), _integer(spec, "seed", field, 0, 2**63, default=0)
    draw, name = _sampler(kind, spec, field, tokens, base)
    rng, lengths, total = random.Random(seed), [], 0
    while total < tokens:
        if len(lengths) == MAX_SEQUENCES:
            raise ValueError(f"{field}: draws more than {MAX_SEQUENCES} sequences before reaching tokens={tokens}; raise the lengths or lower tokens")
        length = min(draw(rng), tokens - total)
        lengths.append(length)
        total += length
    return Batch(tuple(lengths), f"{name}/{tokens}#{seed}")


def _sampler(kind: str, spec: dict, field: str, tokens: int, base: Path | None):
    """``(draw(rng) -> a length ≥ 1, label)`` of a named distribution."""
    if kind == "uniform":
        low = _integer(spec, "low", field, 1, MAX_TOKENS)
        high = _integer(spec, "high", field, low, MAX_TOKENS, what=f"an integer >= low ({low})")
        return (lambda rng: rng.randint(low, high)), f"uniform({low}-{high})"
    most = _integer(spec, "max", field, 1, MAX_TOKENS, default=tokens)
    if kind == "lognormal":
        median, sigma = _number(spec, "median", field, 1.0), _number(spec, "sigma", field, 0.0)
        mu = math.log(median)
        return (lambda rng: max(1, min(most, round(rng.lognormvariate(mu, sigma))))), f"lognormal({median:g},{sigma:g},max {most})"
    lengths, counts, digest = read_histogram(spec["file"], f"{field}.file", base)
    return (lambda rng: min(most, rng.choices(lengths, counts)[0])), f"histogram({Path(spec['file']).name}:{digest},max {most})"


def histogram_path(name, field: str, base: Path | None) -> Path:
    """The histogram file ``name`` names, relative to the scenario's folder ``base``: it must lie under that
    folder, or under the data root the user names (``$ATTNBENCH_DATA``), links resolved; else a ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}: expected a file name (relative to the scenario), got {quote(name)}")
    folder = (base or Path.cwd()).resolve()
    roots = [folder, *([Path(os.environ[DATA_ENV]).expanduser().resolve()] if os.environ.get(DATA_ENV) else [])]
    path = (folder / name).resolve()
    if not any(path.is_relative_to(root) for root in roots):
        within = " or ".join(f"{root}" for root in roots)
        raise ValueError(f"{field}: {quote(name)} is outside {within}; a histogram file lies under the scenario's folder (or ${DATA_ENV}, where set)")
    if not path.exists():
        raise ValueError(f"{field}: no such file {quote(str(path))} (a histogram file, relative to the scenario)")
    return path


def read_histogram(name, field: str, base: Path | None) -> tuple[list[int], list[int], str]:
    """A captured histogram file (``histogram_path``, at most ``MAX_HISTOGRAM_BYTES``): its lengths, their counts
    and the first 8 hex digits of its sha256. An error names the file and line, never quotes its content."""
    path = histogram_path(name, field, base)
    try:
        data = read_small(path, MAX_HISTOGRAM_BYTES, "a histogram file")
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    lengths, counts = [], []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        text = line.split("#")[0].strip()
        if not text:
            continue
        parts = [part.strip() for part in text.split(",")]
        if len(parts) != 2 or not all(part.isdigit() for part in parts) or int(parts[0]) < 1:
            raise ValueError(f"{field}: {path}, line {number}: expected 'length,count' (a positive integer, an integer >= 0)")
        lengths.append(int(parts[0]))
        counts.append(int(parts[1]))
    if not lengths or sum(counts) == 0:
        raise ValueError(f"{field}: {path} holds no length with a count above 0")
    return lengths, counts, hashlib.sha256(data).hexdigest()[:8]


def _positive(item) -> bool:
    return isinstance(item, int) and not isinstance(item, bool) and item >= 1


def _integer(spec: dict, key: str, field: str, low: int, high: int, *, default: int | None = None, what: str | None = None) -> int:
    value = spec.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{field}.{key}: expected {what or f'an integer from {low} to {high}'}, got {quote(value)}")
    return value


def _number(spec: dict, key: str, field: str, low: float) -> float:
    value = spec[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < low:
        raise ValueError(f"{field}.{key}: expected a number >= {low:g}, got {quote(value)}")
    return float(value)
