"""The report's tables: failures, model, quality, every timed cell, backends side by side, and
compare's table (machines side by side: ``harness.report.machines``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from ..common.formatting import flag, format_ratio, format_seconds, fraction, mib, percent, present, relative_error, si, text
from ..results.compare import UNSTABLE_SUFFIX, CompareResult, format_median, is_unstable
from ..results.identity import CELL_KEY
from .cells import TIMED_MODES, base_label, tasks_of
from .figures import Table, natural_columns, table

#: The quality table's columns after those of the tasks (``harness.tasks.Task.metrics``).
COMMON_QUALITY_METRICS = ("words_per_s", "peak_mem_bytes", "wall_s")
#: The caption of a table with a median measured unstable (shown with compare.UNSTABLE_SUFFIX).
UNSTABLE_NOTE = (
    "A time marked * was measured unstable (its median never reached measure.target_rel_ci, or another process took a core it needed): "
    "do not trust it; ratios with one are left out of means."
)


def cell_columns(cells: pd.DataFrame) -> list[tuple[str, str, Callable]]:
    """The columns that name a cell: line label, machine (when several), mode, axes."""
    machine = [("machine", "machine", text)] if cells["machine"].nunique() > 1 else []
    return [("variant", "series", text), *machine, ("mode", "mode", text), ("axes", "axes_text", text)]


def failures_table(cells: pd.DataFrame) -> Table | None:
    failures = cells[cells["status"] != "ok"].sort_values(["status", "series", "mode"], key=natural_columns)
    if failures.empty:
        return None
    columns = cell_columns(cells) + [("status", "status", text), ("message", "error", text)]
    caption = "Every cell without valid numbers (oom, error, nan, skipped) and its message; failed cells are the 'x' marks on the plots."
    return table("Cells that failed or were skipped", failures, columns, caption, classes="status")


def model_table(cells: pd.DataFrame) -> Table | None:
    """Model-level cells in the paper's shape: variant, d_dot, words/s, memory."""
    model = cells[cells["target"] == "model"].sort_values(["series", "mode"], key=natural_columns)
    if model.empty:
        return None
    columns = [
        ("variant", "variant", text),
        ("d_dot", "params.d_dot", text),
        ("params", "params_text", text),
        *cell_columns(cells)[1:],
        ("words/s", "metrics.words_per_s", si),
        ("memory", "metrics.peak_mem_bytes", mib),
        ("status", "status", text),
    ]
    return table("Model: words per second and memory", model, columns, "words/s: tokens per second of one training step (one word per token).")


def quality_table(cells: pd.DataFrame) -> Table | None:
    """Every quality metric the cells have: their tasks' own columns, then throughput, memory, time."""
    quality = cells[cells["mode"] == "quality"]
    metrics = dict.fromkeys([*(metric for task in tasks_of(quality) for metric in task.metrics), *COMMON_QUALITY_METRICS])
    found = [metric for metric in metrics if f"metrics.{metric}" in quality and quality[f"metrics.{metric}"].notna().any()]
    if not found:
        return None
    quality = quality[quality[[f"metrics.{m}" for m in found]].notna().any(axis=1)].sort_values(["series", "mode"], key=natural_columns)
    columns = cell_columns(cells) + [(_quality_header(m), f"metrics.{m}", _quality_format(m)) for m in found]
    return table("Quality", quality, columns)


def _quality_header(metric: str) -> str:
    """``words_per_s`` -> ``words/s``, ``peak_mem_bytes`` -> ``peak memory``, ``wall_s`` -> ``wall (s)``."""
    if metric.endswith("_per_s"):
        return metric.removesuffix("_per_s") + "/s"
    return {"peak_mem_bytes": "peak memory", "wall_s": "wall (s)"}.get(metric, metric)


def _quality_format(metric: str) -> Callable:
    return si if metric.endswith("_per_s") else mib if metric.endswith("_bytes") else text


def timing_table(cells: pd.DataFrame) -> Table | None:
    ok = cells[(cells["status"] == "ok") & cells["mode"].isin(TIMED_MODES)]
    if ok.empty:
        return None
    ok = ok.sort_values(["mode", "series", f"axes.{cells['x_axis'].iloc[0]}"])
    columns = cell_columns(cells) + [
        ("timing", "clock", text),
        ("median", "metrics.median_s", format_seconds),
        ("p20", "metrics.p20_s", format_seconds),
        ("p80", "metrics.p80_s", format_seconds),
        ("±CI", "metrics.rel_ci", percent),
        ("stability", "stability_text", text),
        ("error", "error_text", text),
        ("checked against", "checked_against", text),
        ("tokens/s", "metrics.tokens_per_s", si),
        ("roofline", "metrics.roofline_fraction", fraction),
        ("bound", "metrics.bound", text),
        ("peak memory", "metrics.peak_mem_bytes", mib),
        ("other cores", "metrics.load.other_cores", fraction),
        ("throttled", "metrics.throttled", text),
    ]
    caption = (
        "timing: what timed one sample (metrics.clock; on the CPU the wall time by perf_counter for measure.timing events and wall, "
        "the operators' self CPU time for profiler; on a GPU CUDA events, graph replays, perf_counter to synchronize or the profiler's "
        "device time; a cell recorded without it shows its measure.timing; docs/profiling.md); times of two modes are not comparable. "
        "±CI: half the 95 % interval of the median, relative; unstable: it stayed wider than measure.target_rel_ci, or (disturbed) "
        "another process took a core the cell's threads needed while it was timed (metrics.disturbed). error: the "
        "relative L2 error against the float64 reference (metrics.rel_error); 'inaccurate: 8.1e-02 > 5e-02' where it is beyond the "
        "tolerance of the cell's dtype (metrics.rel_error_tolerance: its speed is not to be compared). checked against "
        f"(metrics.rel_error_reference): {'; '.join(CHECKED_AGAINST_TEXT)}. roofline: the fraction of the machine's calibrated limit "
        "(docs/results.md, 'Roofline'). other cores: the cores other processes kept busy meanwhile."
    )
    records = ok.to_dict("records")
    ok = ok.assign(
        stability_text=[_stability(record) for record in records],
        error_text=[error_text(record) for record in records],
        checked_against=[checked_against(record) for record in records],
    )
    ok = ok.assign(stability=ok["stability_text"].map(lambda shown: "unstable" if shown.startswith(("unstable", "disturbed")) else "stable"))
    return table("Every timed cell", ok, columns, caption, classes="stability")


def _stability(record: dict) -> str:
    """``unstable``, ``unstable (disturbed)`` where another process took a core it needed (``disturbed`` alone
    in a cell that asked for no verdict: target_rel_ci null), empty when stable, ``-`` when not judged."""
    shown, disturbed = flag(record["metrics.unstable"]), record.get("metrics.disturbed") is True
    if shown == "unstable":
        return "unstable (disturbed)" if disturbed else shown
    return "disturbed" if disturbed else shown


def ranking_table(cells: pd.DataFrame) -> Table | None:
    """The variants' ranking per length distribution (cells of ``axes.lengths``, docs/varlen.md): for each
    machine, timing, mode and batch (its distribution, packing and every other axis), the ok cells fastest
    first by tokens/s, which count real tokens only, so that rankings across distributions compare."""
    if "axes.lengths" not in cells:
        return None
    ok = cells[(cells["status"] == "ok") & cells["mode"].isin(TIMED_MODES) & cells["axes.lengths"].map(present)]
    if ok.empty:
        return None
    show_backend = cells["backend"].nunique() > 1
    rows = []
    for (machine, _, mode, axes), group in ok.groupby(["machine", "timing", "mode", "axes_text"], sort=False):
        ranked = group.sort_values("metrics.tokens_per_s", ascending=False).to_dict("records")
        order = [f"{base_label(r, show_backend)} {marked_rate(r['metrics.tokens_per_s'], r['metrics.unstable'])}" for r in ranked]
        rows.append({"machine": machine, "mode": mode, "axes_text": axes, "ranking": " > ".join(order)})
    frame = pd.DataFrame(rows).sort_values(["mode", "axes_text"], key=natural_columns)
    machine = [("machine", "machine", text)] if cells["machine"].nunique() > 1 else []
    columns = [*machine, ("mode", "mode", text), ("batch", "axes_text", text), ("fastest first (real tokens/s)", "ranking", text)]
    caption = (
        "Per mode and batch of variable-length sequences (L=: its length distribution; packing: packed or padded), the variants "
        f"fastest first by real tokens per second; a rate marked {UNSTABLE_SUFFIX} was measured unstable."
    )
    return table("Ranking per length distribution", frame, columns, caption)


def profile_table(cells: pd.DataFrame) -> Table | None:
    """Each profiled cell's (``attnbench run --profile``) top ``PROFILE_TOP`` operators (CPU) or kernels
    (GPU) by self time, as its record keeps them (``metrics.profile``; the report reads no trace), with
    the trace's file; an ncu or nsys cell's report; why a cell was not profiled."""
    if "metrics.profile.tool" not in cells:
        return None
    profiled = cells[cells["metrics.profile.tool"].map(present)].sort_values(["mode", "series"], key=natural_columns)
    if profiled.empty:
        return None
    rows = [{**record, **row} for record in profiled.to_dict("records") for row in _profile_rows(record)]
    columns = cell_columns(cells) + [
        ("tool", "metrics.profile.tool", text),
        ("operator or kernel", "name", text),
        ("calls", "calls", text),
        ("self time", "self_s", format_seconds),
        ("share", "share", _share),
        ("file", "file", text),
    ]
    caption = (
        f"One call of each cell profiled after its timing (--profile): its {PROFILE_TOP} largest operators (CPU: self CPU time) or "
        "kernels (GPU: self device time) and their share of the call's total; the file is beside the results file (a trace opens "
        "in ui.perfetto.dev or chrome://tracing; docs/profiling.md)."
    )
    return table("Profiles: top operators by self time", pd.DataFrame(rows), columns, caption)


#: The operators or kernels of each profiled cell the report lists (its record keeps harness.measuring.profiling.TOP_OPERATORS).
PROFILE_TOP = 5


def _profile_rows(record: dict) -> list[dict]:
    """The rows of one profiled cell: its top operators, else its ncu/nsys report, else why it was skipped."""
    if present(record.get("metrics.profile.skipped")):
        return [{"name": f"not profiled: {record['metrics.profile.skipped']}"}]
    if present(record.get("metrics.profile.report")):
        return [{"name": "(see the report)", "file": record["metrics.profile.report"]}]
    top = record.get("metrics.profile.top")
    top = top[:PROFILE_TOP] if isinstance(top, list) else []
    return [dict(row, file=record.get("metrics.profile.trace") if index == 0 else "") for index, row in enumerate(top)] or [{"name": "no operator"}]


def _share(value) -> str:
    return "-" if not present(value) else f"{100 * value:.1f}%"


#: What a cell's error was measured against (``metrics.rel_error_reference``, harness.measuring.accuracy), in words.
CHECKED_AGAINST = {
    "reference": "its reference",
    "torch float64 + step loop": "own parallel form + step loop",
    "torch float64": "own parallel form only",
}
#: The same, of a layer or model: its twin in float64 with the torch backend; of a core's decode steps: the parallel form.
TWIN, PARALLEL_FORM = "torch float64 twin", "float64 parallel form"
#: The caption's key to the column.
CHECKED_AGAINST_TEXT = (
    "'its reference': the core's plainest form (core.reference, quadratic or a token loop) in float64, up to 1,024 tokens",
    "'own parallel form + step loop': beyond 1,024 tokens (to 16,384) the torch parallel form in float64, itself checked against "
    "the core's step loop (the recurrent form) in float64 on the CPU",
    "'own parallel form only': the torch parallel form in float64, which the tests tie to the reference at short lengths only "
    "(a core beyond 16,384 tokens, packed or without a reference; LSH, whose parallel form approximates it by design)",
    f"'{PARALLEL_FORM}': a core's decode steps (another form) beyond 1,024 tokens against its torch parallel form in float64",
    f"'{TWIN}': the layer or model itself with the same weights on the torch backend in float64 (its core's own parallel form, at any length)",
)


def error_text(record: dict) -> str:
    """A cell's ``metrics.rel_error`` (``relative_error``); an inaccurate one in words with its tolerance:
    ``inaccurate: 8.1e-02 > 5e-02 (its bfloat16 tolerance)``."""
    error = relative_error(record.get("metrics.rel_error"))
    if record.get("metrics.inaccurate") is not True:
        return error
    bound = record.get("metrics.rel_error_tolerance")
    return f"inaccurate: {error} > {bound:.0e} (its {record.get('axes.dtype')} tolerance)" if present(bound) else f"inaccurate: {error}"


def checked_against(record: dict) -> str:
    """What the cell's error was measured against, in words (``CHECKED_AGAINST``); '-' where it was not measured."""
    reference = record.get("metrics.rel_error_reference")
    if not present(reference):
        return "-"
    if reference == "torch float64" and record.get("target") != "core":
        return TWIN
    if reference == "torch float64" and record.get("mode") == "decode":
        return PARALLEL_FORM
    return CHECKED_AGAINST.get(reference, reference)


# --- backends side by side ----------------------------------------------------------------


def backend_ratios(cells: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Every timed cell of a backend other than ``baseline`` with the baseline backend's cell of the
    same measurement (scenario, variant, params, axes, mode, target, machine): ``baseline_s`` (its
    median time), ``ratio`` (the cell's median over it; missing where either cell failed),
    ``baseline_unstable`` and ``unstable`` (either cell measured unstable).
    ``cells`` from ``prepare``; the rows carry ``variant_label`` (the line label without the backend)."""
    timed = cells[cells["mode"].isin(TIMED_MODES)]
    timed = timed.assign(variant_label=[base_label(record, False) for record in timed.to_dict("records")])
    key = [column for column in CELL_KEY if column != "backend"] + ["machine_key", "timing"]
    base = timed[(timed["backend"] == baseline) & (timed["status"] == "ok")]
    renamed = {"metrics.median_s": "baseline_s", "metrics.unstable": "baseline_unstable"}
    pairs = timed[timed["backend"] != baseline].merge(base[key + list(renamed)].rename(columns=renamed), on=key)
    pairs["baseline_unstable"] = pairs["baseline_unstable"].map(is_unstable)
    return pairs.assign(
        ratio=(pairs["metrics.median_s"] / pairs["baseline_s"]).where(pairs["status"] == "ok"),
        unstable=pairs["baseline_unstable"] | pairs["metrics.unstable"].map(is_unstable),
    )


def backend_table(cells: pd.DataFrame, baseline: str | None) -> Table | None:
    """Per variant, mode and axes: the baseline backend's median time and each other backend's
    ratio to it (its status where it has no time: skipped, error, ...); None with one backend."""
    if baseline is None or cells["backend"].nunique() < 2:
        return None
    pairs = backend_ratios(cells, baseline)
    if pairs.empty:
        return None
    backends = [backend for backend in dict.fromkeys(cells["backend"]) if backend != baseline]
    rows = []
    for _, group in pairs.groupby(["variant_label", "machine", "mode", "axes_text"], sort=False):
        first = group.iloc[0]
        row = {
            "variant_label": first["variant_label"],
            "machine": first["machine"],
            "mode": first["mode"],
            "axes_text": first["axes_text"],
            "baseline_s": format_median(first["baseline_s"], first["baseline_unstable"]),
        }
        for record in group.to_dict("records"):
            row[record["backend"]] = marked_ratio(record["ratio"], record["unstable"]) if present(record["ratio"]) else record["status"]
            if present(record.get("metrics.compile_s")):
                row[f"{record['backend']}_compile_s"] = record["metrics.compile_s"]
        rows.append(row)
    frame = pd.DataFrame(rows).sort_values(["mode", "variant_label", "axes_text"], key=natural_columns)
    machine = [("machine", "machine", text)] if cells["machine"].nunique() > 1 else []
    columns = [
        ("variant", "variant_label", text),
        *machine,
        ("mode", "mode", text),
        ("axes", "axes_text", text),
        (f"{baseline} (median)", "baseline_s", text),
        *((f"{b} / {baseline}", b, text) for b in backends),
    ]
    notes = []
    if "compile_compile_s" in frame:
        columns.append(("compile time", "compile_compile_s", format_seconds))
        notes.append("compile time: the untimed first call of the compile backend (tracing, compiling, one run: metrics.compile_s).")
    ratios = pairs[~pairs["unstable"]].dropna(subset="ratio")
    means = "; ".join(f"{backend} {np.exp(np.log(group['ratio']).mean()):.3f} over {len(group)} cells" for backend, group in ratios.groupby("backend"))
    if pairs["unstable"].any():
        notes.append(UNSTABLE_NOTE)
    caption = " ".join(
        [
            f"Each backend's median time over {baseline}'s on the same cell (report.baseline_backend); below 1 is faster.",
            f"Geometric means: {means or 'none'}.",
            *notes,
        ]
    )
    return table(f"Backends against {baseline}", frame, columns, caption)


def marked_rate(rate, unstable) -> str:
    """A rate (``si``), with compare.UNSTABLE_SUFFIX when it was measured unstable."""
    return si(rate) + (UNSTABLE_SUFFIX if is_unstable(unstable) else "")


def marked_ratio(ratio, unstable: bool) -> str:
    """A ratio (``format_ratio``), with compare.UNSTABLE_SUFFIX when a time in it was measured unstable."""
    return format_ratio(ratio) + (UNSTABLE_SUFFIX if unstable else "")


def compare_table(result: CompareResult) -> Table:
    """compare's table; a median measured unstable is shown with a * (``format_median``)."""
    columns = [
        ("scenario", "scenario", text),
        ("variant", "variant", text),
        ("params", "params", text),
        ("axes", "axes", text),
        ("mode", "mode", text),
        ("base", "base_text", text),
        ("head", "head_text", text),
        ("ratio", "ratio", format_ratio),
        ("CI low", "ci_low", format_ratio),
        ("CI high", "ci_high", format_ratio),
        ("mark", "mark", text),
        ("note", "note", text),
    ]
    shown = result.table.assign(
        **{
            f"{side}_text": [format_median(seconds, unstable) for seconds, unstable in zip(result.table[f"{side}_median_s"], result.table[f"{side}_unstable"])]
            for side in ("base", "head")
        }
    )
    caption = result.summary() + (f" {UNSTABLE_NOTE}" if result.unstable_shown() else "")
    return table("Comparison of two commits", shown, columns, caption, classes="mark")
