"""The axes of a speed cell, one table: each axis's name, its short label (``describe``, compare's
and the report's cell names), what it means, and whether a plot may put it on its x axis. The
scenario's schema (``harness.scenarios.schema.Axes``) validates them; everything that names them reads
this table. Plain Python: the report imports it without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    name: str
    #: the label in a cell's shape (``T=512``); None: shown as ``name=value``
    short: str | None
    doc: str
    #: a plot may have it on its x axis (a number)
    x: bool = False
    #: part of a cell's shape in ``describe`` (not dtype and device, shown apart, nor a mode's settings)
    shape: bool = True
    #: every speed cell has it (the others only when their scenario sets them)
    always: bool = False


TABLE = (
    Axis("seq_len", "T", "tokens per sequence; of a packed batch (axes.lengths), its longest", x=True, always=True),
    Axis("batch", "B", "sequences per call; of a packed batch, how many it packs", x=True, always=True),
    Axis("heads", "H", "heads of the output: the query heads, or the value heads of GVA", x=True, always=True),
    Axis("d_key", "Dk", "query/key head dimension", x=True, always=True),
    Axis("d_value", "Dv", "value head dimension", x=True, always=True),
    Axis("new_tokens", None, "decode steps after the prefill (decode.new_tokens)", x=True, shape=False),
    Axis("head_ratio", "G", "grouped heads: each of the fewer heads serves G of the output's (GQA's key/value heads, GVA's query/key heads)", x=True),
    Axis("dtype", None, "the inputs' dtype", shape=False, always=True),
    Axis("device", None, "where the cell runs", shape=False, always=True),
    Axis("model", None, "the LM preset of a model cell", shape=False),
    Axis("lengths", "L", "the sequence lengths of a packed batch: a distribution, its token budget and seed"),
    Axis("packing", None, "packed (one row, cu_seqlens) or padded (a dense batch, each sequence padded to the longest)"),
)
BY_NAME = {axis.name: axis for axis in TABLE}
#: The axes every speed cell has, in the order cells are expanded.
SPEED = tuple(axis.name for axis in TABLE if axis.always)
#: The axes a scenario may set beyond ``SPEED`` (absent from a cell, and from its id, when unset).
OPTIONAL = ("lengths", "packing", "head_ratio")
#: Short labels, in the table's order.
SHORT = {axis.name: axis.short for axis in TABLE if axis.short}
#: Axes a plot may put on its x axis, in order of preference.
X_CANDIDATES = tuple(axis.name for axis in TABLE if axis.x)
#: Axes left out of a cell's shape in ``describe``.
UNSHAPED = tuple(axis.name for axis in TABLE if not axis.shape)
