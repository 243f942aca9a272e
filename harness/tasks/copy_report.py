"""The copy task (Katharopoulos et al. 2020, §4.1) as the registry and the report see it: its entry in
``harness.tasks`` and how its results read, its loss curves. It trains in ``harness.tasks.copy``, imported
only when a cell runs (so a report never imports a model or a variant)."""

from __future__ import annotations

from . import Score, Task, register


def loss_at(losses: list[list[float]], step: int) -> float | None:
    """The loss of the curve's point at ``step`` (None if the curve has no such point)."""
    return next((loss for at, loss in losses if int(at) == step), None)


def _ok(cells):
    return cells[(cells["status"] == "ok") & cells["metrics.losses"].notna()] if "metrics.losses" in cells else cells.iloc[:0]


def _curve_plot(cells, figures, name: str):
    """Training loss against gradient steps, one panel per sequence length (as Figure 2)."""
    ok = _ok(cells)
    if ok.empty:
        return None
    from ..report.figures import new_figure

    lengths = sorted(ok["axes.seq_len"].unique())
    figure, axes = new_figure(len(lengths))
    for ax, length in zip(axes, lengths):
        for record in ok[ok["axes.seq_len"] == length].to_dict("records"):
            steps, losses = zip(*record["metrics.losses"])
            ax.plot(steps, losses, color=figures.colours[record["series"]], linewidth=1.2)
        threshold = ok["metrics.loss_threshold"].iloc[0]
        ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"T = {int(length)}", xlabel="gradient steps", ylabel="training loss (nats per copied symbol)", yscale="log")
    figures.legend(figure, ok, False)
    title = "Copy task: training loss against gradient steps"
    caption = (
        f"{title} (Katharopoulos et al. 2020, Figure 2): each point the mean loss of the steps since the previous one; "
        "the dotted line is the loss threshold of 'steps to threshold'; chance is ln(symbols)."
    )
    return figures.save(figure, f"{name}-copy-loss", title, caption)


def _curve_table(cells):
    """Loss at a quarter, half and all of the steps, steps to the threshold and accuracy."""
    ok = _ok(cells)
    if ok.empty:
        return None
    from ..common.formatting import text
    from ..report.figures import natural_columns, table

    def at(record, share):
        losses = record["metrics.losses"]
        step = losses[-1][0] * share
        nearest = min(losses, key=lambda point: abs(point[0] - step))
        return f"{loss_at(losses, nearest[0]):.3g} @ {int(nearest[0])}"

    rows = ok.sort_values(["axes.seq_len", "series"], key=natural_columns).assign(
        quarter=lambda f: [at(r, 0.25) for r in f.to_dict("records")],
        half=lambda f: [at(r, 0.5) for r in f.to_dict("records")],
        end=lambda f: [at(r, 1.0) for r in f.to_dict("records")],
    )
    columns = [
        ("variant", "series", text),
        ("T", "axes.seq_len", text),
        ("loss @ ¼", "quarter", text),
        ("loss @ ½", "half", text),
        ("loss @ end", "end", text),
        ("steps to threshold", "metrics.steps_to_threshold", text),
        ("accuracy", "metrics.accuracy", text),
        ("exact copies", "metrics.exact", text),
    ]
    threshold = ok["metrics.loss_threshold"].iloc[0]
    caption = f"Training loss (mean of the logged steps) at the step shown; steps to reach loss ≤ {threshold:g} ('-': never); accuracy of the copied half."
    return table("Copy task", rows, columns, caption)


def report_sections(cells, figures, name: str) -> list:
    """The loss curves and their table."""
    return [_curve_plot(cells, figures, name), _curve_table(cells)]


register(
    Task(
        name="copy",
        config="harness.tasks.copy_config:CopyConfig",
        axes=("seq_len",),
        run="harness.tasks.copy:run_cell",
        d_keys=lambda config, axes: [config.d_model // config.n_heads],
        any_device=True,
        metrics=("loss", "steps_to_threshold", "accuracy"),
        report=report_sections,
        score=Score("loss", higher_is_better=False),
    )
)
