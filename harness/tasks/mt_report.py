"""The translation task (Vaswani et al. 2017) as the registry and the report see it: its entry in
``harness.tasks`` and how its results read. It trains in ``harness.tasks.mt``, imported
only when a cell runs (so a report never imports a model or a variant)."""

from __future__ import annotations

from . import Score, Task, register

register(
    Task(
        name="mt",
        config="harness.tasks.mt_config:MTConfig",
        axes=(),
        run="harness.tasks.mt:run_cell",
        d_keys=lambda config, axes: [config.head_width],
        any_device=True,
        metrics=("bleu", "valid_loss", "sentences_per_s"),
        score=Score("bleu", higher_is_better=True),
    )
)
