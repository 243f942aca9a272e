"""The language-modelling task (Schlag et al. 2021, §6.3) as the registry and the report see it: its entry in
``harness.tasks`` and how its results read. It trains in ``harness.tasks.lm``, imported
only when a cell runs (so a report never imports a model or a variant)."""

from __future__ import annotations

from . import Score, Task, register

register(
    Task(
        name="lm",
        config="harness.tasks.lm_config:LMConfig",
        axes=("seq_len",),
        run="harness.tasks.lm:run_cell",
        d_keys=lambda config, axes: [config.head_width],
        any_device=True,
        metrics=("valid_ppl", "test_ppl", "valid_ppl_sliding", "valid_ppl_carry", "valid_ppl_segment", "test_ppl_segment"),
        score=Score("valid_ppl", higher_is_better=False),
    )
)
