"""The image generation task (Katharopoulos et al. 2020, §4.2) as the registry and the report see it: its entry in
``harness.tasks`` and how its results read, its bits/dim and speed table. It trains in ``harness.tasks.image_gen``, imported
only when a cell runs (so a report never imports a model or a variant)."""

from __future__ import annotations

import math

from . import Score, Task, register


def speed_columns(cells) -> list[str]:
    """The lengths timed with untrained weights, as the ``metrics.speed.<P>.images_per_s`` columns hold them."""
    found = {column.split(".")[2] for column in cells.columns if column.startswith("metrics.speed.") and column.endswith(".images_per_s")}
    return sorted(found, key=int)


def _speed_table(cells):
    """Bits/dim, images/s and s/image per variant; images/s at each timed length with the
    speed-up over softmax of the same run (machine, scenario, axes)."""
    ok = cells[(cells["status"] == "ok")] if "metrics.bits_per_dim" in cells else cells.iloc[:0]
    ok = ok[ok["metrics.bits_per_dim"].notna()] if not ok.empty else ok
    if ok.empty:
        return None
    from ..common.formatting import si, text
    from ..report.figures import natural_columns, table

    lengths = speed_columns(ok)
    rows = []
    for _, group in ok.groupby(["machine_key", "scenario", "axes.d_model"], sort=False):
        softmax = group[group["variant"] == "softmax"]
        for record in group.sort_values("series", key=natural_columns).to_dict("records"):
            row = dict(record)
            for length in lengths:
                column = f"metrics.speed.{length}.images_per_s"
                reference = softmax[column].iloc[0] if not softmax.empty else math.nan
                row[f"speedup_{length}"] = f"{record[column] / reference:.3g}×" if reference > 0 else "-"
            rows.append(row)
    import pandas as pd

    frame = pd.DataFrame(rows)
    columns = [
        ("variant", "series", text),
        ("d_model", "axes.d_model", text),
        ("bits/dim", "metrics.bits_per_dim", text),
        ("images/s", "metrics.images_per_s", si),
        ("s/image", "metrics.s_per_image", si),
    ]
    for length in lengths:
        columns += [(f"images/s @ {length} px", f"metrics.speed.{length}.images_per_s", si), (f"× softmax @ {length}", f"speedup_{length}", text)]
    caption = (
        "Bits per dimension on the test images (256 levels); generation through the recurrent step of a batch of images, "
        "median of the timed repeats, at the data's length (trained) and at each length shown with untrained weights "
        "(a step's time depends on the shapes, not the weights); '× softmax': images/s over softmax's in the same run."
    )
    return table("Image generation", frame, columns, caption)


def report_sections(cells, figures, name: str) -> list:
    """The bits/dim and generation-speed table."""
    return [_speed_table(cells)]


register(
    Task(
        name="image-gen",
        config="harness.tasks.image_gen_config:ImageGenConfig",
        axes=("d_model",),
        run="harness.tasks.image_gen:run_cell",
        d_keys=lambda config, axes: [d // config.n_heads for d in axes["d_model"]],
        any_device=True,
        metrics=("bits_per_dim", "images_per_s"),
        report=report_sections,
        score=Score("bits_per_dim", higher_is_better=False),
    )
)
