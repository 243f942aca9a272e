"""Machines side by side: the same cells measured on several machines, each other machine's (B) time over the
scenario's first machine's (A), with compare's bootstrap interval and verdict, for cells measured on the same
terms only; every other pair is shown with the reason it is left out of every mean. Each cell's fraction of its
own machine's calibrated roof splits a ratio into the machine's part (the roofs) and the code's (how much of
each roof it reaches). How to read it: docs/reports.md, "Machines side by side"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..common.formatting import counted, format_ratio, fraction, present, text
from ..results.compare import MIN_SAMPLES, RESAMPLES, bootstrap_ratios, format_median, is_unstable, pair_seed, timing_mark
from ..results.identity import CELL_KEY
from .cells import TIMED_MODES, base_label
from .figures import Table, natural, natural_columns, table

ALPHA = 0.05  #: every interval of the section is a 1 - ALPHA percentile bootstrap interval
SEED = 0  #: with each cell's identity (compare.pair_seed): the same files give the same intervals
#: compare's mark (timing_mark at factor 1: the interval excludes 1) in the section's words.
VERDICTS = {"worse": "B slower", "better": "B faster"}
NO_DIFFERENCE = "no clear difference"
#: Why a pair is left out of every mean, by kind (a pair may have several).
LEFT_OUT = {
    "failed": "failed on one machine",
    "timing": "timed differently (measure.timing, metrics.clock)",
    "threads": "timed on different torch threads",
    "unstable": "unstable or disturbed",
    "inaccurate": "inaccurate",
    "samples": f"fewer than {MIN_SAMPLES} raw samples",
}


@dataclass
class SideBySide:
    """One machine B beside a scenario's first machine A: the headline means, the machine-or-code sentence, every pair."""

    title: str
    headline: Table
    machine_or_code: str
    pairs: Table


def machine_pairs(cells: pd.DataFrame) -> pd.DataFrame:
    """For each scenario timed on several machines: every timed cell of another machine (B) beside the same cell
    (``CELL_KEY``: variant, backend, parameters, axes but the device name, dtype, mode, target) on the scenario's
    first machine (A), where either is ok; of a cell timed in several modes, the pairs in the same mode. Each pair
    has ``ratio`` (B over A, of the medians of the raw samples: compare's ``bootstrap_ratios``), ``ci_low``,
    ``ci_high``, ``draws`` (the bootstrap ratios), ``left_out`` (the kinds of ``LEFT_OUT`` that keep it out of every
    mean), ``comparable`` (none does), ``why_not`` (them in words), ``verdict``, both roof fractions, ``roofs`` and ``use``
    (B's roofline time over A's, A's fraction over B's: ratio = roofs × use) and ``mostly`` ("machine" or "code",
    the factor farther from 1). ``cells`` from ``prepare``."""
    timed, show_backend = cells[cells["mode"].isin(TIMED_MODES)], cells["backend"].nunique() > 1
    found = []
    for _, scenario in timed.groupby("scenario", sort=True):
        machines = list(dict.fromkeys(scenario["machine"]))
        reference = scenario[scenario["machine"] == machines[0]]
        for machine in machines[1:]:
            pairs = reference.merge(scenario[scenario["machine"] == machine], on=CELL_KEY, suffixes=("_a", "_b"))
            same = pairs["timing_a"] == pairs["timing_b"]
            either_ok = (pairs["status_a"] == "ok") | (pairs["status_b"] == "ok")
            pairs = pairs[(same | ~same.groupby([pairs[key] for key in CELL_KEY]).transform("any")) & either_ok]
            found += [_pair(pair, show_backend) for pair in pairs.to_dict("records")]
    return pd.DataFrame(found, columns=PAIR_COLUMNS)


PAIR_COLUMNS = [
    "scenario", "label", "mode", "axes_text", "a", "b", "median_a", "median_b", "unstable_a", "unstable_b", "ratio", "ci_low", "ci_high",
    "draws", "left_out", "comparable", "why_not", "verdict", "roof_a", "roof_b", "roofs", "use", "mostly",
]  # fmt: skip


def _pair(pair: dict, show_backend: bool) -> dict:
    """One row of ``machine_pairs`` from a merged pair of cells (suffixes _a, _b)."""
    reasons = _reasons(pair)
    why_not = "; ".join(words for _, words in reasons)
    samples = [pair.get(f"metrics.samples_s_{side}") for side in "ab"]
    draws, ratio = None, _ratio(pair["metrics.median_s_b"], pair["metrics.median_s_a"])
    if all(isinstance(side, list) and len(side) >= MIN_SAMPLES for side in samples):
        ratio, draws, _ = bootstrap_ratios(*samples, seed=pair_seed(SEED, pair))
    low, high = np.quantile(draws, [ALPHA / 2, 1 - ALPHA / 2]) if draws is not None else (np.nan, np.nan)
    roof_a, roof_b = pair.get("metrics.roofline_fraction_a"), pair.get("metrics.roofline_fraction_b")
    roofs, use = _ratio(pair.get("metrics.roofline_s_b"), pair.get("metrics.roofline_s_a")), _ratio(roof_a, roof_b)
    return {
        "scenario": pair["scenario"],
        "label": base_label({**pair, **{key: pair[f"{key}_b"] for key in ("params_text", "axes.d_key", "axes.d_value")}}, show_backend),
        "mode": pair["mode"],
        "axes_text": pair["axes_text_b"],
        "a": pair["machine_a"],
        "b": pair["machine_b"],
        "median_a": pair["metrics.median_s_a"],
        "median_b": pair["metrics.median_s_b"],
        "unstable_a": _unsteady(pair, "a") is not None,
        "unstable_b": _unsteady(pair, "b") is not None,
        "ratio": ratio,
        "ci_low": low,
        "ci_high": high,
        "draws": draws,
        "left_out": list(dict.fromkeys(kind for kind, _ in reasons)),
        "comparable": not reasons,
        "why_not": why_not,
        "verdict": f"not compared: {why_not}" if reasons else verdict(ratio, low, high),
        "roof_a": roof_a,
        "roof_b": roof_b,
        "roofs": roofs,
        "use": use,
        "mostly": np.nan if not (present(roofs) and present(use)) else "machine" if abs(np.log(roofs)) >= abs(np.log(use)) else "code",
    }


def verdict(ratio: float, low: float, high: float) -> str:
    """B slower or B faster where the interval excludes 1 (compare's ``timing_mark`` at factor 1), else no clear difference."""
    return VERDICTS.get(timing_mark(ratio, low, high, 1.0), NO_DIFFERENCE)


def _ratio(top, bottom) -> float:
    """``top / bottom``; NaN unless both are positive numbers."""
    return top / bottom if present(top) and present(bottom) and top > 0 and bottom > 0 else np.nan


def _unsteady(pair: dict, side: str) -> str | None:
    """``disturbed`` (another process took a core it needed: metrics.disturbed), ``unstable`` (metrics.unstable), or None."""
    if pair.get(f"metrics.disturbed_{side}") is True:
        return "disturbed"
    return "unstable" if is_unstable(pair.get(f"metrics.unstable_{side}")) else None


def _reasons(pair: dict) -> list[tuple[str, str]]:
    """What keeps a pair out of every mean, as (kind of ``LEFT_OUT``, words): the terms its two cells were measured
    on differ (timing mode or clock; torch threads, of CPU cells), or a side failed, is unstable, inaccurate or has
    too few raw samples for an interval. Dtype, backend and the rest of the cell are equal: pairs match on them."""
    reasons = []
    for key, kind in (("timing", "timing"), ("metrics.clock", "timing"), ("metrics.torch_threads", "threads")):
        a, b = pair.get(f"{key}_a"), pair.get(f"{key}_b")
        applies = key != "metrics.torch_threads" or pair.get("axes.device_a") == pair.get("axes.device_b") == "cpu"
        if applies and present(a) and present(b) and a != b:
            reasons.append((kind, f"{key.removeprefix('metrics.').replace('_', ' ')} A {text(a)}, B {text(b)}"))
    for side in "AB":
        record = {key.removesuffix(f"_{side.lower()}"): value for key, value in pair.items() if key.endswith(f"_{side.lower()}")}
        samples = record.get("metrics.samples_s")
        if record["status"] != "ok":
            reasons.append(("failed", f"{side} {record['status']}"))
            continue
        if (state := _unsteady(pair, side.lower())) is not None:
            reasons.append(("unstable", f"{side} {state}"))
        if record.get("metrics.inaccurate") is True:
            reasons.append(("inaccurate", f"{side} inaccurate"))
        if not isinstance(samples, list) or len(samples) < MIN_SAMPLES:
            reasons.append(("samples", f"{side} has {len(samples) if isinstance(samples, list) else 0} raw samples"))
    return reasons


# --- the headline: geometric means with intervals ----------------------------------------


def geometric_mean(pairs: pd.DataFrame) -> tuple[float, float, float]:
    """The geometric mean of the comparable ``pairs``' ratios and its 1 - ALPHA interval: each resample draws the
    cells with replacement and, for each drawn cell, its ratio in that resample of compare's bootstrap (``draws``), so
    the interval is as wide as the cells differ from each other and as each is noisy. NaNs without a pair."""
    if pairs.empty:
        return np.nan, np.nan, np.nan
    logs = np.log(np.vstack(pairs["draws"].to_list()))
    chosen = np.random.default_rng(SEED).integers(len(pairs), size=(RESAMPLES, len(pairs)))
    means = logs[chosen, np.arange(RESAMPLES)[:, None]].mean(axis=1)
    low, high = np.exp(np.quantile(means, [ALPHA / 2, 1 - ALPHA / 2]))
    return float(np.exp(np.log(pairs["ratio"]).mean())), float(low), float(high)


def _mean_text(pairs: pd.DataFrame, of: int) -> str:
    """``0.612 [0.548, 0.701] B faster, 12 of 22 cells``; ``none of 4 cells comparable``."""
    if pairs.empty:
        return f"none of {of} cells comparable" if of else "-"
    mean, low, high = geometric_mean(pairs)
    return f"{format_ratio(mean)} [{low:.3f}, {high:.3f}] {verdict(mean, low, high)}, {len(pairs)} of {of} cells"


def _headline(pairs: pd.DataFrame, title: str) -> Table:
    """Per mode (columns) the geometric mean over every variant's comparable cells, then over each variant's; the
    variants without a comparable cell are named in the caption."""
    modes = [mode for mode in TIMED_MODES if mode in set(pairs["mode"])]
    comparable = pairs["comparable"]
    labels = sorted(pairs["label"].unique(), key=natural)
    compared = [label for label in labels if comparable[pairs["label"] == label].any()]
    rows = []
    for label, own in [("all variants", pairs), *((label, pairs[pairs["label"] == label]) for label in compared)]:
        rows.append({"label": label, **{mode: _mean_text(own[(own["mode"] == mode) & own["comparable"]], (own["mode"] == mode).sum()) for mode in modes}})
    left = pd.Series([kind for kinds in pairs["left_out"] for kind in kinds]).value_counts()
    reasons = ", ".join(f"{left[kind]} {LEFT_OUT[kind]}" for kind in LEFT_OUT if kind in left)
    none = [label for label in labels if label not in compared]
    caption = " ".join(
        [
            f"Per mode, the geometric mean of B's median time over A's on the cells measured on the same terms (timing mode and "
            f"clock, torch threads; both stable and accurate), with its {1 - ALPHA:.0%} bootstrap interval (the cells drawn with "
            "replacement, each drawn cell's ratio from its own bootstrap: as wide as the cells differ and as each is noisy); "
            "B faster or slower only where the interval excludes 1.",
            f"Left out of every mean ({counted(int((~comparable).sum()), 'cell')}; some for several reasons): {reasons}." if reasons else "No cell left out.",
            f"No comparable cell: {', '.join(none)}." if none else "",
        ]
    )
    return table(title, pd.DataFrame(rows), [("variant", "label", text), *((mode, mode, text) for mode in modes)], caption.strip())


# --- the machine or the code -----------------------------------------------------------------


#: How a machine-or-code sentence states its rule.
RULE = (
    "Rule: each cell's ratio B/A is the ratio of the two machines' roofline times for it (its FLOPs and bytes against each "
    "machine's calibrated peaks: the machine) times A's fraction of its roof over B's (how well the code uses each machine: "
    "the code); the factor farther from 1 explains the cell."
)


def machine_or_code(pairs: pd.DataFrame) -> str:
    """Which explains most comparable cells of one pair of machines, the machine (B's roof is lower or higher, the
    fractions of it alike) or the code (it reaches a smaller or larger fraction of B's roof), with ``RULE``."""
    known = pairs[pairs["comparable"] & pairs["mostly"].map(present)]
    if known.empty:
        return "No comparable cell has a calibrated roof on both machines (machine.calibration), so the report cannot tell the machine from the code."
    machine, code = known[known["mostly"] == "machine"], known[known["mostly"] == "code"]
    most = "the machine" if len(machine) > len(code) else "the code" if len(code) > len(machine) else "neither: as many each"
    return (
        f"Of {counted(len(known), 'comparable cell')} with a roof on both machines, {len(machine)} differ mostly by the machine "
        f"(B's roof is lower for {(machine['roofs'] > 1).sum()}, higher for {(machine['roofs'] < 1).sum()}; the roofs differ more than "
        f"the fractions of them reached) and {len(code)} mostly by the code (it reaches a smaller fraction of B's roof than of A's "
        f"for {(code['use'] > 1).sum()}, a larger one for {(code['use'] < 1).sum()}): for most, {most}. {RULE}"
    )


# --- the tables ------------------------------------------------------------------------------------


def side_by_side(cells: pd.DataFrame) -> list[SideBySide]:
    """Per scenario and machine B beside its first machine A: the headline, the machine-or-code sentence, the pairs."""
    pairs = machine_pairs(cells)
    return [
        _side_by_side(scenario, a, b, group.drop(columns=["scenario", "a", "b"]))
        for (scenario, a, b), group in pairs.groupby(["scenario", "a", "b"], sort=False)
    ]


def _side_by_side(scenario: str, a: str, b: str, pairs: pd.DataFrame) -> SideBySide:
    title = f"{scenario}: B = {b} against A = {a}"
    shown = pairs.assign(
        a_text=[format_median(s, u) for s, u in zip(pairs["median_a"], pairs["unstable_a"])],
        b_text=[format_median(s, u) for s, u in zip(pairs["median_b"], pairs["unstable_b"])],
        interval=["-" if not present(low) else f"[{low:.3f}, {high:.3f}]" for low, high in zip(pairs["ci_low"], pairs["ci_high"])],
        split=[_split(roofs, use, mostly) for roofs, use, mostly in zip(pairs["roofs"], pairs["use"], pairs["mostly"])],
    )
    shown = shown.assign(mark=shown["verdict"].where(shown["comparable"], "not compared"))
    shown = shown.sort_values(["comparable", "ratio", "mode", "label"], ascending=[False, False, True, True], key=natural_columns, kind="stable")
    columns = [
        ("variant", "label", text),
        ("mode", "mode", text),
        ("axes", "axes_text", text),
        ("A median", "a_text", text),
        ("B median", "b_text", text),
        ("B / A", "ratio", format_ratio),
        (f"{1 - ALPHA:.0%} interval", "interval", text),
        ("verdict", "verdict", text),
        ("A roof fraction", "roof_a", fraction),
        ("B roof fraction", "roof_b", fraction),
        ("B / A = machine × code", "split", text),
    ]
    caption = (
        f"Every cell timed on both machines, the comparable ones first, each part by ratio, largest first. B / A: B's median "
        f"time over A's (of the raw samples, their severe outliers left out, as attnbench compare does), with its {1 - ALPHA:.0%} "
        "bootstrap interval; verdict: B slower or faster where the interval excludes 1, else no clear difference; a cell measured "
        "on other terms on the two machines, failed, unstable (* beside its median) or disturbed, inaccurate, or with too few "
        "raw samples is not compared, and says why. Roof fraction: the share of its own machine's calibrated roof the cell "
        "reaches (docs/results.md, 'Roofline'). Machine × code: the ratio split into the two roofs' ratio and A's fraction "
        "over B's (about: the fractions are of the recorded medians), the larger part named."
    )
    headline = _headline(pairs, f"{scenario}: geometric means of B / A")
    return SideBySide(title, headline, machine_or_code(pairs), table(title, shown, columns, caption, classes="mark"))


def _split(roofs, use, mostly) -> str:
    """``0.160 × 5.620 (code)``; ``-`` without a roof on both machines."""
    return "-" if not present(mostly) else f"{format_ratio(roofs)} × {format_ratio(use)} ({mostly})"
