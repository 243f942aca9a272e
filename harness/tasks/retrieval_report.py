"""The associative retrieval task (Schlag et al. 2021, §6.1) as the registry and the report see it: its entry in
``harness.tasks`` and how its results read, its capacity plot and update-rules table. It trains in ``harness.tasks.retrieval``, imported
only when a cell runs (so a report never imports a model or a variant)."""

from __future__ import annotations

from . import Score, Task, register


def _setting(cells):
    """Each cell's retrieval setting (1: capacity, 2: update rules); 1 where a record has none."""
    import pandas as pd

    return cells["task.setting"].fillna(1) if "task.setting" in cells else pd.Series(1, index=cells.index)


def _capacity_plot(cells, figures, name: str):
    """Setting 1: the best evaluation loss against the number of keys S, one line per variant,
    each variant's d_dot marked on the axis in its colour (Schlag et al. 2021, Fig. 2)."""
    from ..report.figures import new_figure
    from ..report.seeds import draw_over_seeds

    ok = cells[(cells["status"] == "ok") & cells["metrics.loss"].notna() & (_setting(cells) == 1)]
    if ok.empty:
        return None
    figure, (ax,) = new_figure(1)
    for series, group in ok.groupby("series"):
        colour = figures.colours[series]
        draw_over_seeds(ax, group, "axes.S", "metrics.loss", colour)
        if "metrics.d_dot" in group and group["metrics.d_dot"].notna().any():
            ax.axvline(group["metrics.d_dot"].dropna().iloc[0], color=colour, linestyle=":", linewidth=1)
    ax.set(xlabel="number of keys S", ylabel="best evaluation loss", title="retrieval")
    figures.legend(figure, ok, False)
    title = "Retrieval loss against the number of keys"
    caption = (
        f"{title}: one line per variant (the mean over seeds, a band from the lowest to the highest where several were run); "
        "the dotted line in a variant's colour marks its d_dot (its memory's capacity)."
    )
    return figures.save(figure, f"{name}-capacity", title, caption)


def _update_rules_table(cells):
    """Setting 2 (Schlag et al. 2021, §6.1.2): one row per update rule, one column per number of
    keys S, each entry the best evaluation loss and the steps it took."""
    from ..common.formatting import text
    from ..report.figures import table

    rules = cells[(cells["status"] == "ok") & cells["metrics.loss"].notna() & (_setting(cells) == 2)]
    if rules.empty:
        return None
    entry = rules.assign(entry=[f"{loss:.4g} ({steps:.0f} steps)" for loss, steps in zip(rules["metrics.loss"], rules["metrics.steps"])])
    pivot = entry.pivot_table(index="series", columns="axes.S", values="entry", aggfunc="last").reset_index()
    columns = [("update rule", "series", text)] + [(f"S = {int(S)}", S, text) for S in pivot.columns[1:]]
    caption = "Setting 2 (L = 2S pairs with replacement; the answer is the most recent value): best evaluation loss (steps taken)."
    return table("Retrieval: update rules", pivot, columns, caption)


def report_sections(cells, figures, name: str) -> list:
    """The capacity plot (setting 1) and the update-rules table (setting 2)."""
    if "metrics.loss" not in cells:
        return []
    return [_capacity_plot(cells, figures, name), _update_rules_table(cells)]


register(
    Task(
        name="retrieval",
        config="harness.tasks.retrieval_config:RetrievalConfig",
        axes=("S", "d_key"),
        run="harness.tasks.retrieval:run_cell",
        metrics=("loss",),
        report=report_sections,
        score=Score("loss", higher_is_better=False, stop_field="target_loss"),
    )
)
