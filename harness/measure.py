"""Honest wall-clock timing: warm-up first, synchronise the device, repeat, keep every sample."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Timing:
    """Raw per-iteration samples in seconds, with the order statistics a report quotes."""

    samples_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples_s))

    @property
    def p20_s(self) -> float:
        return float(np.percentile(self.samples_s, 20))

    @property
    def p80_s(self) -> float:
        return float(np.percentile(self.samples_s, 80))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_callable(fn, *, warmup: int = 2, repeats: int = 7, device="cpu") -> Timing:
    """Run ``fn()`` ``warmup`` times untimed, then ``repeats`` times, each timed alone with
    ``time.perf_counter`` between device synchronisations."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    _synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))
