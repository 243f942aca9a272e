"""How well a set of timing samples knows its median: the relative half-width of the median's
bootstrap interval. Shared by the sampler (harness.measuring.measure) and the reader of old results files
(harness.results), so it needs numpy only. Bootstraps here and in harness.results.compare resample in
chunks (``resampled_medians``), so their memory is bounded whatever the sample count."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Resamples of the bootstrap interval of a median.
CI_RESAMPLES = 1000
#: Resampled values a bootstrap holds at once (about 16 MB per float64 array of them), at least one resample.
CHUNK_VALUES = 1 << 21


def chunk_rows(width: int) -> int:
    """Resamples of ``width`` values each drawn together: ``CHUNK_VALUES`` values, at least one resample."""
    return max(1, CHUNK_VALUES // max(1, width))


def resampled_medians(resamples: int, width: int, draw: Callable[[int], np.ndarray]) -> np.ndarray:
    """The medians of ``resamples`` resamples of ``width`` values, ``draw(rows)`` returning the next
    ``rows`` resamples as a ``[rows, width]`` array, ``chunk_rows(width)`` rows at a time. A ``draw``
    that consumes its random stream in order gives the same medians whatever the chunk size."""
    rows = chunk_rows(width)
    return np.concatenate([np.median(draw(min(rows, resamples - start)), axis=1) for start in range(0, resamples, rows)])


def median_rel_ci(samples, *, alpha: float = 0.05) -> float:
    """Half the width of the 1-alpha percentile bootstrap interval of the median of ``samples``
    (the larger side), relative to the median; seeded, so the same samples give the same figure."""
    samples = np.asarray(samples, dtype=float)
    rng = np.random.default_rng(0)
    draw = lambda rows: samples[(rng.random((rows, samples.size)) * samples.size).astype(np.intp)]
    medians = resampled_medians(CI_RESAMPLES, samples.size, draw)
    low, high = np.quantile(medians, [alpha / 2, 1 - alpha / 2])
    median = np.median(samples)
    return float(max(median - low, high - median) / median) if median > 0 else 0.0
