"""The MQAR task (Arora et al. 2023) as the registry and the report see it: its entry in
``harness.tasks`` and how its results read, its accuracy plot. It trains in ``harness.tasks.mqar``, imported
only when a cell runs (so a report never imports a model or a variant)."""

from __future__ import annotations

from . import Score, Task, register


def _accuracy_plot(cells, figures, name: str):
    """Accuracy against sequence length, one line per variant, one panel per model width."""
    ok = cells[(cells["status"] == "ok") & cells["metrics.accuracy"].notna()]
    if ok.empty:
        return None
    from ..report.figures import new_figure
    from ..report.seeds import draw_over_seeds

    widths = sorted(ok["axes.d_model"].unique())
    figure, axes = new_figure(len(widths))
    for ax, width in zip(axes, widths):
        for series, group in ok[ok["axes.d_model"] == width].groupby("series"):
            draw_over_seeds(ax, group, "axes.seq_len", "metrics.accuracy", figures.colours[series])
        ax.set(title=f"d_model {int(width)}", xlabel="sequence length", ylabel="accuracy", ylim=(0, 1.02))
    figures.legend(figure, ok, False)
    title = "MQAR accuracy against sequence length"
    caption = (
        f"{title}: best evaluation accuracy on the queried values (the mean over seeds, a band from the lowest to the highest "
        "where several were run); one panel per model width."
    )
    return figures.save(figure, f"{name}-mqar", title, caption)


def report_sections(cells, figures, name: str) -> list:
    """The accuracy plot."""
    return [_accuracy_plot(cells, figures, name)] if "metrics.accuracy" in cells else []


register(
    Task(
        name="mqar",
        config="harness.tasks.mqar_config:MQARConfig",
        axes=("seq_len", "d_model"),
        run="harness.tasks.mqar:run_cell",
        d_keys=lambda config, axes: axes["d_model"],
        metrics=("accuracy",),
        report=report_sections,
        score=Score("accuracy", higher_is_better=True, threshold=0.9),
    )
)
