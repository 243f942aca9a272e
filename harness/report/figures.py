"""What every plot and table of a report is made of: the ``Plot`` and ``Table`` records the
template renders, ``Figures`` (the report's output folder, one colour per line label, one line
style per machine), a figure of several panels and the plain-text tick labels of its log axes.
Shared by ``harness.report``, the report sections each task registers (``harness.tasks``) and
the history page (``harness.history``)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatterSciNotation

from ..common.files import own_directory, write_atomic

#: Matplotlib settings under which a report's plots are made: every label, title, legend and tick is
#: plain text (a results file's ``a$b$c`` is not parsed as mathtext, which fails the whole figure);
#: ``Figures.save`` gives log axes ``PlainLogFormatter``, as their own tick labels are mathtext.
PLAIN_TEXT = {"text.parse_math": False}
#: A mathtext exponent's characters as unicode superscripts.
SUPERSCRIPTS = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
#: The legend's font size, the height of one of its rows in font sizes (a row takes 1.63) and the width
#: of one of its columns in inches, beside the panels.
LEGEND_SIZE, LEGEND_ROW, LEGEND_WIDTH = "small", 1.8, 3.2
#: How a failed cell is drawn: an x, in its line's colour.
FAILURE_MARK = {"marker": "x", "markersize": 9, "markeredgewidth": 2, "linestyle": "none"}


def natural(label):
    """A sort key that orders the numbers inside labels by value: chunk_size=8 before chunk_size=16."""
    return re.sub(r"\d+", lambda number: number.group().zfill(12), label) if isinstance(label, str) else label


def natural_columns(column: pd.Series) -> pd.Series:
    return column.map(natural)


class PlainLogFormatter(LogFormatterSciNotation):
    """The tick labels matplotlib chooses for a log axis, in plain text: 10⁻², 4×10⁻² where
    matplotlib writes ``$\\mathdefault{4\\times10^{-2}}$``."""

    def __call__(self, x, pos=None):
        label = re.sub(r"^\$\\mathdefault\{(.*)\}\$$", r"\1", super().__call__(x, pos))
        label = re.sub(r"\^\{(.*?)\}", lambda power: power.group(1).translate(SUPERSCRIPTS), label)
        return self.fix_minus(label.replace(r"\times", "×"))


def plain_log_ticks(figure: Figure) -> None:
    """Put ``PlainLogFormatter`` in the place of the mathtext formatter that a log scale gives each axis of ``figure``."""
    for axis in (axis for ax in figure.axes for axis in (ax.xaxis, ax.yaxis)):
        for formatter, use in ((axis.get_major_formatter(), axis.set_major_formatter), (axis.get_minor_formatter(), axis.set_minor_formatter)):
            if type(formatter) is LogFormatterSciNotation:
                use(PlainLogFormatter(axis.get_transform().base, formatter.labelOnlyBase, formatter.minor_thresholds))


def decades(values, margin: float = 0.1) -> tuple[float, float]:
    """Limits of a log axis (base 10) that hold ``values``, ``margin`` decades clear of its ends, and the decades
    on either side of them: matplotlib then labels decades only, no more of them than fit side by side
    (``LogLocator``), where a narrower axis labels 2×, 3×, 4× ... of a decade on top of each other."""
    exponents = np.log10(np.asarray(values, dtype=float))
    low, high = np.floor(exponents.min()), np.ceil(exponents.max())
    return 10.0 ** min(low, exponents.min() - margin), 10.0 ** max(high + (high == low), exponents.max() + margin)


@dataclass
class Plot:
    title: str
    caption: str
    file: str
    data_uri: str


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    row_classes: list[str] = field(default_factory=list)
    caption: str = ""


def table(title: str, frame: pd.DataFrame, columns: list[tuple[str, str, Callable]], caption: str = "", classes: str | None = None) -> Table:
    """A Table of ``frame``: ``columns`` are (header, column, formatter); missing columns show '-'."""
    records = frame.to_dict("records")
    rows = [[formatter(record.get(column)) for _, column, formatter in columns] for record in records]
    row_classes = [re.sub(r"[^a-z0-9]+", "-", str(record.get(classes)).lower()).strip("-") for record in records] if classes else []
    return Table(title, [header for header, _, _ in columns], rows, row_classes, caption)


@dataclass
class Figures:
    """Everything plots share in one report: the output folder, colours and line styles."""

    out_dir: Path
    colours: dict[str, tuple]
    styles: dict[str, str]

    def save(self, figure: Figure, name: str, title: str, caption: str) -> Plot:
        """Write ``figure`` to plots/NAME.png (its log axes labelled in plain text) and return it with its data URI."""
        plain_log_ticks(figure)
        buffer = io.BytesIO()
        FigureCanvasAgg(figure).print_png(buffer)
        data = buffer.getvalue()
        path = own_directory(self.out_dir / "plots") / f"{name}.png"
        write_atomic(path, data)
        return Plot(title, caption, f"plots/{path.name}", "data:image/png;base64," + base64.b64encode(data).decode("ascii"))

    def legend(self, figure: Figure, cells: pd.DataFrame, failures: bool) -> None:
        """Colours of the lines shown, line styles of the machines, the failure marker: in as many columns as
        it takes to fit the figure's height, each further column widening the figure by ``LEGEND_WIDTH``."""
        handles = [Line2D([], [], color=self.colours[s], marker="o", label=s) for s in sorted(cells["series"].unique(), key=natural)]
        machines = cells["machine"].unique()
        if len(machines) > 1:
            handles += [Line2D([], [], color="black", linestyle=self.styles[m], label=m) for m in machines]
        if failures:
            handles.append(Line2D([], [], color="black", label="failed (oom / error / crashed / nan)", **FAILURE_MARK))
        rows = max(1, int(figure.get_figheight() * 72 / (LEGEND_ROW * FontProperties(size=LEGEND_SIZE).get_size_in_points())))
        columns = -(-len(handles) // rows)
        figure.set_figwidth(figure.get_figwidth() + LEGEND_WIDTH * (columns - 1))
        figure.legend(handles=handles, loc="outside right upper", fontsize=LEGEND_SIZE, ncols=columns)


def new_figure(panels: int) -> tuple[Figure, list]:
    columns = min(panels, 3)
    rows = -(-panels // columns)
    figure = Figure(figsize=(4.6 * columns + LEGEND_WIDTH, 3.6 * rows), layout="constrained")
    with sns.axes_style("whitegrid"):
        axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for extra in axes[panels:]:
        extra.set_visible(False)
    return figure, list(axes[:panels])
