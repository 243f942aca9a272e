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


def _time_once(fn, device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def time_interleaved(fns: dict, *, warmup: int = 2, repeats: int = 7, device="cpu") -> dict:
    """Time several callables in rounds (A B C A B C ...), so that drift of a noisy machine
    hits all of them alike. Each is warmed up ``warmup`` times first; each sample is one
    call timed with ``time.perf_counter`` between device synchronisations."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    device = torch.device(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _synchronize(device)
    samples = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            samples[key].append(_time_once(fn, device))
    return {key: Timing(tuple(values)) for key, values in samples.items()}


def time_callable(fn, *, warmup: int = 2, repeats: int = 7, device="cpu") -> Timing:
    """Run ``fn()`` ``warmup`` times untimed, then time ``repeats`` calls one by one."""
    return time_interleaved({None: fn}, warmup=warmup, repeats=repeats, device=device)[None]
