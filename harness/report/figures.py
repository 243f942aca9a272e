"""What every plot and table of a report is made of: the ``Plot`` and ``Table`` records the
template renders, ``Figures`` (the report's output folder, one colour per line label, one line
style per machine, the keys to both beside and below the panels), colours told apart
(``distinct_colours``), a figure of several panels and the plain-text tick labels of its log axes.
Shared by ``harness.report``, the report sections each task registers (``harness.tasks``) and
the history page (``harness.history``)."""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatterSciNotation, NullFormatter

from ..common.files import own_directory, write_atomic

#: Matplotlib settings under which a report's plots are made: every label, title, legend and tick is
#: plain text (a results file's ``a$b$c`` is not parsed as mathtext, which fails the whole figure);
#: ``Figures.save`` gives log axes ``PlainLogFormatter``, as their own tick labels are mathtext.
PLAIN_TEXT = {"text.parse_math": False}
#: A mathtext exponent's characters as unicode superscripts.
SUPERSCRIPTS = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
#: The legend's font size, and the width in inches that ``new_figure`` leaves beside its panels for a legend
#: (``Figures.legend`` then sets it to the legend's measured width).
LEGEND_SIZE, LEGEND_WIDTH = "small", 3.2
#: Inches kept clear between a key and the figure's edge or the other key.
KEY_PAD = 0.15
#: Matplotlib's categorical palettes, the pool ``distinct_colours`` draws from after tab10's ten.
CATEGORICAL = ("tab10", "Dark2", "Set1", "tab20", "tab20b", "tab20c", "Set2", "Paired", "Accent", "Set3")
#: The CIELAB lightness a line's colour keeps to: darker reads as black, lighter vanishes on the white page.
LIGHTNESS = (25, 80)
#: How a failed cell is drawn: an x, in its line's colour.
#: Marker fills that tell machines apart on a plot of points (``Figures.fill``): line styles do not show on a point.
MACHINE_FILLS = ("full", "none", "left", "bottom", "right", "top")
FAILURE_MARK = {"marker": "x", "markersize": 9, "markeredgewidth": 2, "linestyle": "none"}


def lab(rgb) -> np.ndarray:
    """sRGB colours (rows of three in [0, 1]) in CIELAB (D65), where the distance between two colours is how
    different they look (ΔE: about 2 is just noticed, 20 tells two lines apart at a glance)."""
    rgb = np.asarray(rgb, dtype=float)
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = linear @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]).T / np.array([0.9505, 1.0, 1.089])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


@cache
def distinct_colours(count: int) -> list[tuple]:
    """``count`` colours, each as far (in CIELAB) from all before it as the pool allows: tab10's ten, then the
    farthest of ``CATEGORICAL``'s other colours in ``LIGHTNESS``, one at a time (24 stay at least ΔE 22 apart,
    where a hue circle's neighbours are 16° apart). Past the pool's size, it repeats."""
    pool = list(dict.fromkeys(tuple(colour[:3]) for name in CATEGORICAL for colour in colormaps[name].colors))
    coordinates = lab(pool)
    usable = [index for index in range(len(pool)) if index < 10 or LIGHTNESS[0] < coordinates[index, 0] < LIGHTNESS[1]]
    chosen = usable[:10]
    nearest = np.linalg.norm(coordinates[usable][:, None] - coordinates[chosen][None], axis=-1).min(axis=1)
    while len(chosen) < min(count, len(usable)):
        pick = int(np.argmax(nearest))
        chosen.append(usable[pick])
        nearest = np.minimum(nearest, np.linalg.norm(coordinates[usable] - coordinates[usable[pick]], axis=-1))
    return [pool[chosen[index % len(chosen)]] for index in range(count)]


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
    """Put ``PlainLogFormatter`` in the place of the mathtext formatter that a log scale gives each axis of ``figure``;
    then, on an axis whose labels meet once drawn, label decades only: matplotlib labels 2×, 3×, 4× ... of a decade
    by the decades an axis spans (up to about 1.5), not by the room the labels take."""
    logs = []
    for axis in (axis for ax in figure.axes for axis in (ax.xaxis, ax.yaxis)):
        for formatter, use in ((axis.get_major_formatter(), axis.set_major_formatter), (axis.get_minor_formatter(), axis.set_minor_formatter)):
            if type(formatter) is LogFormatterSciNotation:
                use(PlainLogFormatter(axis.get_transform().base, formatter.labelOnlyBase, formatter.minor_thresholds))
                logs.append(axis)
    if logs:
        FigureCanvasAgg(figure)
        figure.draw_without_rendering()
    for axis in logs:
        boxes = [label.get_window_extent() for label in drawn_labels(axis)]
        if any(first.overlaps(second) for first, second in combinations(boxes, 2)):
            axis.set_minor_formatter(NullFormatter())


def drawn_labels(axis) -> list:
    """The tick labels ``axis`` draws: within its view, visible, with text (after its figure was drawn)."""
    low, high = sorted(axis.get_view_interval())
    ticks = axis.get_major_ticks() + axis.get_minor_ticks()
    return [tick.label1 for tick in ticks if low <= tick.get_loc() <= high and tick.label1.get_visible() and tick.label1.get_text()]


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

    def fill(self, machine: str) -> str:
        """The marker fill that tells ``machine``'s points apart where points stand alone (``MACHINE_FILLS``, in
        ``styles``' order: full for the first)."""
        return MACHINE_FILLS[list(self.styles).index(machine) % len(MACHINE_FILLS)]

    def save(self, figure: Figure, name: str, title: str, caption: str) -> Plot:
        """Write ``figure`` to plots/NAME.png (its log axes labelled in plain text) and return it with its data URI."""
        plain_log_ticks(figure)
        buffer = io.BytesIO()
        FigureCanvasAgg(figure).print_png(buffer)
        data = buffer.getvalue()
        path = own_directory(self.out_dir / "plots") / f"{name}.png"
        write_atomic(path, data)
        return Plot(title, caption, f"plots/{path.name}", "data:image/png;base64," + base64.b64encode(data).decode("ascii"))

    def legend(self, figure: Figure, cells: pd.DataFrame, failures: bool, named: bool = False, machines: str = "lines") -> None:
        """The key to the lines beside the panels (colour: the line label, unless the panels already name each,
        ``named``: bars; the failure marker) in as many columns as it takes to fit the figure's height, and, when
        the cells are of several machines, the key to them below the panels: their line styles (``machines="lines"``),
        their marker fills (``"points"``: ``fill``) or none (``"panels"``: each panel names its machine); the figure
        widened to hold both, as measured (``fit_keys``)."""
        labels = [] if named else sorted(cells["series"].unique(), key=natural)
        handles = [Line2D([], [], color=self.colours[s], marker="o", label=s) for s in labels]
        if failures:
            handles.append(Line2D([], [], color="black", label="failed (oom / error / crashed / nan)", **FAILURE_MARK))
        names = cells["machine"].unique() if machines != "panels" and cells["machine"].nunique() > 1 else []
        if machines == "points":
            keys, title = [Line2D([], [], color="black", marker="o", fillstyle=self.fill(m), linestyle="none", label=m) for m in names], "marker fill: machine"
        else:
            keys, title = [Line2D([], [], color="black", linestyle=self.styles[m], label=m) for m in names], "line style: machine"
        below = figure.legend(handles=keys, loc="outside lower center", fontsize=LEGEND_SIZE, ncols=len(keys), title=title) if keys else None
        fit_keys(figure, handles, below)


def fit_keys(figure: Figure, handles: list, below=None) -> None:
    """Put the key of ``handles`` beside ``figure``'s panels in the fewest columns that fit its height above the key
    ``below`` (a legend already placed under the panels, or None), and set the figure's width to its panels'
    (``new_figure``'s, less ``LEGEND_WIDTH``) and the key's, measured: every entry inside the saved figure."""
    renderer = FigureCanvasAgg(figure).get_renderer()

    def inches(legend) -> tuple[float, float]:
        box = legend.get_window_extent(renderer)
        return box.width / figure.dpi, box.height / figure.dpi

    below_width, below_height = inches(below) if below is not None else (0.0, 0.0)
    room, width = figure.get_figheight() - below_height - 2 * KEY_PAD, 0.0
    for columns in range(1, len(handles) + 1):
        key = figure.legend(handles=handles, loc="outside right upper", fontsize=LEGEND_SIZE, ncols=columns)
        width, height = inches(key)
        if height <= room or columns == len(handles):
            break
        key.remove()
    figure.set_figwidth(max(figure.get_figwidth() - LEGEND_WIDTH + width + KEY_PAD, below_width + 2 * KEY_PAD))


def new_figure(panels: int, height: float = 3.6) -> tuple[Figure, list]:
    """A figure of ``panels`` panels, three a row, each 4.6 inches wide and ``height`` high, and room for a legend beside them."""
    columns = min(panels, 3)
    rows = -(-panels // columns)
    figure = Figure(figsize=(4.6 * columns + LEGEND_WIDTH, height * rows), layout="constrained")
    with sns.axes_style("whitegrid"):
        axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for extra in axes[panels:]:
        extra.set_visible(False)
    return figure, list(axes[:panels])
