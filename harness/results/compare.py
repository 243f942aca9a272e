"""Compare two sets of results from one machine (two commits, say): per cell, the ratio of
median times head/base with a bootstrap confidence interval, and a mark.

Cells are matched on what they measure (scenario, variant, backend, params, axes, mode,
target). A timing difference between two machines is not a regression, so ``compare``
refuses inputs measured on different machines; putting machines side by side is what the
report does (``harness.report``). The marks, the statistics and the exit codes are
explained in docs/reports.md. Like the report, this module reads results files only.
"""

from __future__ import annotations

import hashlib
import json
import math
import textwrap
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..common.formatting import format_ratio, format_seconds, present
from ..measuring.busyness import BUSY_CORES
from ..measuring.stats import resampled_medians
from . import FAILED, load
from .identity import CELL_KEY, identify, latest

EXIT_OK = 0  #: no regression
EXIT_REGRESSION = 1  #: at least one cell is worse or newly failing
EXIT_INCOMPARABLE = 2  #: the inputs cannot be compared (different machines, nothing in common, usage error)

REGRESSION_MARKS = ("worse", "newly failing")
#: Every mark, most alarming first (the order of rows without a ratio).
MARKS = (
    "worse",
    "newly failing",
    "still failing",
    "too few samples to decide",
    "unstable: not compared",
    "unchanged",
    "better",
    "fixed",
    "not comparable",
    "new",
    "removed",
)
UNDECIDED = "too few samples to decide"
#: The mark of a pair with a side measured unstable (``metrics.unstable``): its timing is not judged.
UNSTABLE = "unstable: not compared"
#: After a median measured unstable, wherever it is shown (compare's table, the report's tables).
UNSTABLE_SUFFIX = " *"
RESAMPLES = 2000
MIN_SAMPLES = 2
NOTE_WIDTH = 100  #: format_table wraps a note onto lines of at most this many characters (never cuts it)

TABLE_COLUMNS = [
    "scenario",
    "variant",
    "backend",
    "params",
    "axes",
    "mode",
    "target",
    "base_median_s",
    "head_median_s",
    "base_unstable",
    "head_unstable",
    "ratio",
    "ci_low",
    "ci_high",
    "mark",
    "note",
]


def format_median(seconds, unstable) -> str:
    """A median time (``format_seconds``), with ``UNSTABLE_SUFFIX`` when it was measured unstable."""
    return format_seconds(seconds) + (UNSTABLE_SUFFIX if present(seconds) and is_unstable(unstable) else "")


def is_unstable(value) -> bool:
    """Whether a ``metrics.unstable`` entry says unstable (False for a missing one)."""
    return present(value) and bool(value)


class CompareError(ValueError):
    """The two sides cannot be compared; the message says why and what to do instead."""


# --- statistics ---------------------------------------------------------------------------


#: Criterion's "severe" outlier fences: a sample beyond 3 interquartile ranges from the quartiles.
OUTLIER_FENCE = 3.0


def _without_outliers(samples) -> np.ndarray:
    """``samples`` without its severe outliers (outside [Q1 - 3 IQR, Q3 + 3 IQR], as criterion
    classifies them): a sample 8x the others because the scheduler ran something else is the
    machine's, not the code's."""
    samples = np.asarray(samples, dtype=float)
    q1, q3 = np.percentile(samples, [25, 75])
    fence = OUTLIER_FENCE * (q3 - q1)
    return samples[(samples >= q1 - fence) & (samples <= q3 + fence)]


def _padded(rounds: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The rounds as one ``[rounds, longest]`` array (padded with NaN) and their lengths."""
    lengths = np.array([len(r) for r in rounds])
    table = np.full((len(rounds), lengths.max()), np.nan)
    for row, values in zip(table, rounds):
        row[: len(values)] = values
    return table, lengths


def _bootstrap_medians(rounds: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """``RESAMPLES`` medians of two-stage resamples of a side measured in ``rounds``: rounds
    with replacement, then as many samples as the longest round with replacement within each
    chosen round, so that drift between rounds widens the interval as it should (one round:
    the plain bootstrap). Drawn in bounded chunks (``stats.resampled_medians``) from two streams
    of ``rng``, one for the rounds and one for the samples, so the chunk size changes nothing."""
    table, lengths = _padded(rounds)
    count, longest = table.shape
    round_rng, sample_rng = rng.spawn(2)

    def draw(rows: int) -> np.ndarray:
        chosen = (round_rng.random((rows, count, 1)) * count).astype(np.intp)
        within = (sample_rng.random((rows, count, longest)) * lengths[chosen]).astype(np.intp)
        return table[chosen, within].reshape(rows, count * longest)

    return resampled_medians(RESAMPLES, count * longest, draw)


def _as_rounds(side) -> list[np.ndarray]:
    """A side as a list of rounds: a flat list of samples is one round."""
    side = list(side)
    return [np.asarray(r, dtype=float) for r in side] if side and isinstance(side[0], (list, tuple, np.ndarray)) else [np.asarray(side, dtype=float)]


def bootstrap_ratios(base, head, *, seed) -> tuple[float, np.ndarray, int]:
    """The ratio of medians head/base, the ``RESAMPLES`` ratios of resampled medians of each side
    (``_bootstrap_medians``) and how many severe outliers were left out (``_without_outliers``, per
    round). A side is a list of raw samples, or a list of rounds of samples."""
    rng = np.random.default_rng(seed)
    sides = [_as_rounds(side) for side in (base, head)]
    kept = [[_without_outliers(r) for r in rounds] for rounds in sides]
    dropped = sum(r.size for rounds in sides for r in rounds) - sum(r.size for rounds in kept for r in rounds)
    base_kept, head_kept = kept
    ratios = _bootstrap_medians(head_kept, rng) / _bootstrap_medians(base_kept, rng)
    ratio = np.median(np.concatenate(head_kept)) / np.median(np.concatenate(base_kept))
    return float(ratio), ratios, dropped


def ratio_ci(base, head, *, alpha: float, seed) -> tuple[float, float, float, int]:
    """The ratio of medians head/base, its percentile bootstrap interval at 1-alpha from
    ``bootstrap_ratios`` and how many severe outliers were left out."""
    ratio, ratios, dropped = bootstrap_ratios(base, head, seed=seed)
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return ratio, float(low), float(high), dropped


def _rounds(value) -> list | None:
    """A cell's per-round samples (``metrics.round_samples_s``) when it has two or more
    rounds; None otherwise."""
    rounds = _samples(value)
    if len(rounds) < 2 or not all(_samples(r) for r in rounds):
        return None
    return [_samples(r) for r in rounds]


def timing_mark(ratio: float, low: float, high: float, factor: float) -> str:
    """worse / better when the interval excludes 1 and the ratio passes the factor; "unchanged"
    when the whole interval lies within [1 / factor, factor]; otherwise the interval is too wide
    to tell a change of the factor from none: "too few samples to decide". The ratio is judged as
    the table shows it (``format_ratio``'s three decimals): a ratio shown as 1.100 is never worse
    at factor 1.1, nor one shown as 0.909 better (1 / 1.1 = 0.909...)."""
    ratio, shown = float(format_ratio(ratio)), lambda value: float(format_ratio(value))
    significant = low > 1 or high < 1
    if significant and ratio > shown(factor):
        return "worse"
    if significant and ratio < shown(1 / factor):
        return "better"
    if 1 / factor <= low and high <= factor:
        return "unchanged"
    return UNDECIDED


def pair_seed(seed: int, pair: dict) -> list[int]:
    """A seed per cell, from ``seed`` and the cell's identity, so no cell depends on the others."""
    identity = json.dumps([pair[key] for key in CELL_KEY], default=str)
    return [seed, int(hashlib.sha256(identity.encode()).hexdigest()[:8], 16)]


# --- judging one pair ---------------------------------------------------------------------


def _samples(value) -> list:
    return list(value) if isinstance(value, (list, tuple, np.ndarray)) else []


def _message(pair: dict, side: str) -> str:
    error = pair.get(f"error_{side}")
    return f"{side} {pair[f'status_{side}']}" + (f": {error}" if present(error) else "")


def _machines_note(pair: dict) -> str:
    return (
        f"different machines: base on {pair['machine_base']} (machine {pair['machine_key_base']}), "
        f"head on {pair['machine_head']} (machine {pair['machine_key_head']})"
    )


def timing_of(value) -> str:
    """A cell's timing mode (``metrics.timing``): ``events`` where a record has none (measured before the modes)."""
    return value if present(value) else "events"


def _judge_statuses(pair: dict) -> tuple[str, str] | None:
    """(mark, note) when the statuses alone decide the mark; None when both sides are ok."""
    base, head = pair["status_base"], pair["status_head"]
    if "skipped" in (base, head):
        side = "base" if base == "skipped" else "head"
        return "not comparable", _message(pair, side)
    if base == "ok" and head in FAILED:
        return "newly failing", _message(pair, "head")
    if base in FAILED and head == "ok":
        return "fixed", _message(pair, "base")
    if base in FAILED and head in FAILED:
        return "still failing", _message(pair, "head")
    return None


def _load_notes(pair: dict) -> list[str]:
    """What makes a side's timing suspect: it did not reach its interval target (unstable), or
    other processes kept at least ``BUSY_CORES`` cores busy while it was measured."""
    notes = []
    for side in ("base", "head"):
        cores = pair.get(f"metrics.load.other_cores_{side}")
        if is_unstable(pair.get(f"metrics.unstable_{side}")):
            notes.append(f"{side} unstable (interval of its median ±{pair[f'metrics.rel_ci_{side}']:.0%})")
        if present(cores) and cores >= BUSY_CORES:
            notes.append(f"{side} measured on a busy machine (other processes used {cores:.1f} cores)")
    return notes


def _judge(pair: dict, *, factor: float, alpha: float, seed: int) -> dict:
    """The mark, note and statistics of one row of the outer join of base and head."""
    if pair["_merge"] != "both":
        return {"mark": "removed" if pair["_merge"] == "left_only" else "new", "note": ""}
    if pair["machine_key_base"] != pair["machine_key_head"]:
        return {"mark": "not comparable", "note": _machines_note(pair)}
    timings = [timing_of(pair.get(f"metrics.timing_{side}")) for side in ("base", "head")]
    if pair["mode"] != "quality" and timings[0] != timings[1]:
        return {"mark": "not comparable", "note": f"timed differently: base measure.timing {timings[0]}, head {timings[1]}; measure both in one mode"}
    decided = _judge_statuses(pair)
    if decided is not None:
        return dict(zip(("mark", "note"), decided))
    base, head = _samples(pair["metrics.samples_s_base"]), _samples(pair["metrics.samples_s_head"])
    if min(len(base), len(head)) < MIN_SAMPLES:
        return {"mark": "not comparable", "note": f"fewer than {MIN_SAMPLES} raw samples (base {len(base)}, head {len(head)})"}
    if any(is_unstable(pair.get(f"metrics.unstable_{side}")) for side in ("base", "head")):
        return {"mark": UNSTABLE, "note": "; ".join(_load_notes(pair) + ["measure again on a quieter machine"])}
    base_rounds, head_rounds = _rounds(pair.get("metrics.round_samples_s_base")), _rounds(pair.get("metrics.round_samples_s_head"))
    if base_rounds is not None and head_rounds is not None:
        base, head = base_rounds, head_rounds
    ratio, low, high, dropped = ratio_ci(base, head, alpha=alpha, seed=pair_seed(seed, pair))
    mark = timing_mark(ratio, low, high, factor)
    notes = [f"{dropped} severe outlier(s) left out"] if dropped else []
    notes += _load_notes(pair)
    if mark == UNDECIDED:
        notes.append(f"the interval spans both 1 and the factor {factor:g}: measure with more samples (measure.repeats, measure.target_rel_ci)")
    return {"mark": mark, "note": "; ".join(notes), "ratio": ratio, "ci_low": low, "ci_high": high}


# --- the comparison -----------------------------------------------------------------------


def _side(paths) -> pd.DataFrame:
    """The cells of one side, identified, the latest measurement of each cell."""
    return latest(identify(load(paths)), CELL_KEY)


def _gpu_text(value) -> str:
    return str(value) if present(value) else "none"


def _check_machines(pairs: pd.DataFrame, allow: bool) -> None:
    """Refuse (CompareError) when no matched cell shares a machine, or a GPU name differs."""
    matched = pairs[pairs["_merge"] == "both"]
    if matched.empty or allow:
        return
    other_machine = matched["machine_key_base"] != matched["machine_key_head"]
    other_gpu = matched["gpu_base"].fillna("no GPU") != matched["gpu_head"].fillna("no GPU")
    if not (other_machine.all() or other_gpu.any()):
        return
    example = matched[other_gpu].iloc[0] if other_gpu.any() else matched.iloc[0]
    raise CompareError(
        f"base and head were measured on different machines ({_machines_note(example)}; "
        f"GPU {_gpu_text(example['gpu_base'])} vs {_gpu_text(example['gpu_head'])}). A difference between two machines "
        "is not a regression. Comparing machines is what `attnbench report BASE HEAD` does (side by side, with ratios); "
        "comparing commits on one machine is what `attnbench compare` does. To list these cells as 'not comparable' "
        "instead, pass allow_different_machines=True (--allow-different-machines)."
    )


def _table(pairs: pd.DataFrame, judged: list[dict]) -> pd.DataFrame:
    """The result table: one row per cell, sorted by ratio (descending), then by mark."""
    marks = pd.DataFrame(judged, index=pairs.index).reindex(columns=["mark", "note", "ratio", "ci_low", "ci_high"])
    pick = lambda column: pairs[f"{column}_base"].where(pairs["_merge"] != "right_only", pairs[f"{column}_head"])
    table = pd.DataFrame(
        {
            **{column: pairs[column] for column in ("scenario", "variant", "backend", "mode", "target")},
            "params": pick("params_text"),
            "axes": pick("axes_text"),
            "base_median_s": pairs["metrics.median_s_base"].where(pairs["status_base"] == "ok"),
            "head_median_s": pairs["metrics.median_s_head"].where(pairs["status_head"] == "ok"),
            **{f"{side}_unstable": (pairs[f"status_{side}"] == "ok") & pairs[f"metrics.unstable_{side}"].map(is_unstable) for side in ("base", "head")},
            **marks,
        }
    )
    table["_rank"] = table["mark"].map(MARKS.index)
    table = table.sort_values(["ratio", "_rank"], ascending=[False, True], na_position="last", kind="stable")
    return table.drop(columns="_rank").reindex(columns=TABLE_COLUMNS).reset_index(drop=True)


def compare(base_paths, head_paths, *, factor: float = 1.1, alpha: float = 0.05, seed: int = 0, allow_different_machines: bool = False) -> CompareResult:
    """Match the cells of ``base_paths`` and ``head_paths`` (files or directories, as for
    ``load``) and mark each pair; raises CompareError for results of different machines
    unless ``allow_different_machines`` (then those cells are marked "not comparable")."""
    if not (1 <= factor < math.inf and 0 < alpha < 1):  # NaN fails both: it would make no cell ever worse
        raise CompareError(f"factor must be a finite number >= 1 and alpha in (0, 1); got factor={factor}, alpha={alpha}")
    columns = CELL_KEY + [
        "status",
        "error",
        "machine_key",
        "machine",
        "gpu",
        "params_text",
        "axes_text",
        "metrics.median_s",
        "metrics.samples_s",
        "metrics.round_samples_s",
        "metrics.unstable",
        "metrics.rel_ci",
        "metrics.load.other_cores",
        "metrics.timing",
    ]
    base, head = _side(base_paths), _side(head_paths)
    pairs = base.reindex(columns=columns).merge(head.reindex(columns=columns), on=CELL_KEY, how="outer", suffixes=("_base", "_head"), indicator=True)
    pairs = pairs.sort_values(CELL_KEY, kind="stable").reset_index(drop=True)
    pairs["_merge"] = pairs["_merge"].astype(str)
    _check_machines(pairs, allow_different_machines)
    judged = [_judge(pair, factor=factor, alpha=alpha, seed=seed) for pair in pairs.to_dict("records")]
    return CompareResult(_table(pairs, judged), factor=factor, alpha=alpha)


# --- the result ---------------------------------------------------------------------------


def _text_table(rows: list[list[str]], headers: list[str]) -> str:
    """Columns padded to their widest cell, a rule under the header."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip()
    return "\n".join([line(headers), line(["-" * width for width in widths]), *map(line, rows)])


@dataclass
class CompareResult:
    """The outcome of ``compare``: ``table`` (one row per cell), ``regressions``, ``exit_code``."""

    table: pd.DataFrame
    factor: float
    alpha: float

    @property
    def regressions(self) -> pd.DataFrame:
        """The rows marked "worse" or "newly failing"."""
        return self.table[self.table["mark"].isin(REGRESSION_MARKS)]

    @property
    def exit_code(self) -> int:
        """EXIT_REGRESSION if any regression, else EXIT_INCOMPARABLE if no cell could be
        compared (nothing matched, only across machines, or only sides measured unstable), else EXIT_OK."""
        if not self.regressions.empty:
            return EXIT_REGRESSION
        compared = ~self.table["mark"].isin(("not comparable", UNSTABLE, "new", "removed"))
        return EXIT_OK if compared.any() else EXIT_INCOMPARABLE

    def counts(self) -> dict[str, int]:
        """How many cells got each mark, in the order of ``MARKS``."""
        found = self.table["mark"].value_counts()
        return {mark: int(found[mark]) for mark in MARKS if mark in found}

    def summary(self) -> str:
        """One line: the counts of each mark, the thresholds and the exit code."""
        counts = ", ".join(f"{count} {mark}" for mark, count in self.counts().items()) or "no cells"
        return f"{len(self.table)} cells: {counts} (factor {self.factor:g}, alpha {self.alpha:g}); exit code {self.exit_code}"

    def format_table(self, summary: bool = True) -> str:
        """The table as plain text, each note wrapped onto lines of its own (``NOTE_WIDTH``), then the summary line
        (``summary``)."""
        headers = ["scenario", "variant", "params", "axes", "mode", "base", "head", "ratio", f"{1 - self.alpha:.0%} CI", "mark", "note"]
        rows = []
        for row in self.table.to_dict("records"):
            first, *more = textwrap.wrap(row["note"], NOTE_WIDTH, break_on_hyphens=False) or [""]
            rows.append(
                [
                    row["scenario"],
                    f"{row['variant']}[{row['backend']}]",
                    row["params"] or "-",
                    row["axes"],
                    f"{row['mode']}/{row['target']}",
                    format_median(row["base_median_s"], row["base_unstable"]),
                    format_median(row["head_median_s"], row["head_unstable"]),
                    format_ratio(row["ratio"]),
                    "-" if not present(row["ci_low"]) else f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}]",
                    row["mark"],
                    first,
                ]
            )
            rows += [[""] * (len(headers) - 1) + [line] for line in more]  # the note's next lines, under it
        legend = [f"{UNSTABLE_SUFFIX.strip()} measured unstable: its median never reached measure.target_rel_ci"] if self.unstable_shown() else []
        return "\n".join([_text_table(rows, headers), *legend, *([self.summary()] if summary else [])])

    def unstable_shown(self) -> bool:
        """Whether a median of the table was measured unstable (it is shown with ``UNSTABLE_SUFFIX``)."""
        return bool((self.table["base_unstable"] | self.table["head_unstable"]).any())
