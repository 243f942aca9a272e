"""What a scenario's ``measure`` section may ask of ``harness.measuring.measure``: the timing modes and the
most samples a cell takes. Plain Python: the scenario schema checks a scenario against them before torch loads."""

from __future__ import annotations

#: The timing modes of ``measure.timing``; decode cells time each step and take ``DECODE_TIMINGS``.
TIMINGS = ("events", "cudagraph", "profiler", "wall")
DECODE_TIMINGS = ("events", "wall")
#: What an error about ``cudagraph`` on the CPU offers instead.
CPU_TIMINGS = "events, profiler or wall time the CPU"
#: Adaptive sampling never takes more samples than this (a µs-scale call would take thousands).
MAX_SAMPLES = 1000
