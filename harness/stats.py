"""How well a set of timing samples knows its median: the relative half-width of the median's
bootstrap interval. Shared by the sampler (harness.measure) and the reader of old results files
(harness.results), so it needs numpy only."""

from __future__ import annotations

import numpy as np

#: Resamples of the bootstrap interval of a median.
CI_RESAMPLES = 1000


def median_rel_ci(samples, *, alpha: float = 0.05) -> float:
    """Half the width of the 1-alpha percentile bootstrap interval of the median of ``samples``
    (the larger side), relative to the median; seeded, so the same samples give the same figure."""
    samples = np.asarray(samples, dtype=float)
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(samples, size=(CI_RESAMPLES, samples.size)), axis=1)
    low, high = np.quantile(medians, [alpha / 2, 1 - alpha / 2])
    median = np.median(samples)
    return float(max(median - low, high - median) / median) if median > 0 else 0.0
