"""The settings of a language-modelling run, ``LMConfig``: a scenario's ``task:`` section and the settings
options of ``python -m harness.tasks.lm`` (``harness.tasks.lm`` trains it), torch-free so that a scenario
is checked before torch loads."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ..models import LM_PRESETS, DecoderConfig, SegmentConfig
from . import MAX_BATCH, MAX_LAYERS, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH, Seed, Steps, TaskConfig, one_of

#: DecoderConfig fields that a run sets itself (from its settings, variant and context), so
#: ``model_overrides`` cannot.
_SET_BY_RUN = ("vocab_size", "context", "dropout", "variant", "variant_params", "adaptive_cutoffs", "segment")


#: The largest value of each model size a run may override (``LMConfig.model_overrides``).
_OVERRIDE_BOUNDS = {"n_layers": MAX_LAYERS, "n_heads": MAX_LAYERS, "d_model": MAX_WIDTH, "d_ff": MAX_WIDTH}


def _check_override(name: str, value) -> None:
    """ValueError naming ``model_overrides.<name>`` unless ``value`` is a size within its bound, a
    boolean for ``tie_embeddings``, a positive number for ``adaptive_div_value``."""
    if name in _OVERRIDE_BOUNDS:
        ok, expected = (
            isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _OVERRIDE_BOUNDS[name],
            f"an integer from 1 to {_OVERRIDE_BOUNDS[name]}",
        )
    elif name == "tie_embeddings":
        ok, expected = isinstance(value, bool), "true or false"
    else:
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf, "a positive number"
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {str(value)[:40]!r}")


class LMConfig(TaskConfig):
    """Every setting of a language-modelling run, with its default: a scenario's ``task:``
    section, the settings options of ``python -m harness.tasks.lm`` and what ``run_lm`` takes.
    The model's context is the run's (``axes.seq_len``, ``--context``), not a setting."""

    name: Literal["lm"] = "lm"
    preset: Annotated[str, one_of(LM_PRESETS, "a model preset")] = Field(
        "cpu", description="model sizes: a preset of harness.models.LM_PRESETS (small, medium, cpu)"
    )
    steps: Steps = Field(700, description="optimiser steps")
    batch: int = Field(16, ge=1, le=MAX_BATCH, description="windows per step (the global batch, over all processes)")
    lr: float = Field(2e-3, gt=0, description="peak learning rate (AdamW)")
    warmup: int = Field(50, ge=0, validate_default=True, description="steps of linear warm-up, then cosine decay (at most steps)")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the embeddings and every residual branch")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    clip: float | None = Field(1.0, gt=0, description="gradient norm clipping (none: no clipping)")
    adaptive_cutoffs: list[Annotated[int, Field(le=MAX_VOCAB)]] | None = Field(
        [2000, 10000], description="adaptive softmax cutoffs (none: a full softmax tied to the embedding)"
    )
    eval_tokens: int | None = Field(None, ge=2, description="evaluate on the first N tokens of valid and test (none or all: the whole splits)")
    sliding_tokens: int | None = Field(2048, ge=2, description="sliding-window evaluation on the first N valid tokens (none or all: the whole split)")
    carry: bool = Field(True, description="also evaluate linear-time variants carrying their state across windows")
    eval_every: Steps | None = Field(None, description="steps between validation evaluations (none: at the end only)")
    log_every: Steps = Field(25, description="steps between recorded training losses (and the last step)")
    data: str | None = Field(None, description="a WikiText directory (none: $ATTNBENCH_DATA/wikitext-2, else the shared data)")
    threads: int | None = Field(None, ge=1, le=MAX_LAYERS, description="torch CPU threads (none: torch's default)")
    model_overrides: dict[str, Any] = Field({}, description="model sizes replacing the preset's, e.g. {n_layers: 1, d_model: 32}")
    segment: dict[str, Any] | None = Field(
        None,
        description="segment-level recurrence, {kind: xl | rmt | carry_state, length, segments, memory, bptt} or a kind "
        "(harness.models.SegmentConfig; length defaults to the context)",
    )
    seed: Seed = Field(0, description="seed of the initialisation, the batches and dropout")

    @field_validator("warmup")
    @classmethod
    def _warmup_within_steps(cls, value, info):
        if "steps" in info.data and value > info.data["steps"]:
            raise ValueError(f"must be at most steps = {info.data['steps']}")
        return value

    @field_validator("adaptive_cutoffs")
    @classmethod
    def _increasing_cutoffs(cls, value):
        if value is not None and (not value or value[0] < 1 or any(b <= a for a, b in zip(value, value[1:]))):
            raise ValueError("expected increasing positive word ranks such as [2000, 10000], or none")
        return value

    @field_validator("eval_tokens", "sliding_tokens", mode="before")
    @classmethod
    def _all_tokens(cls, value):
        return None if isinstance(value, str) and value.lower() == "all" else value

    @field_validator("model_overrides")
    @classmethod
    def _model_sizes(cls, value, info):
        allowed = [field.name for field in fields(DecoderConfig) if field.name not in _SET_BY_RUN]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: expected model fields among {', '.join(allowed)} "
                "(the context is the run's; dropout, adaptive_cutoffs and segment are settings of their own)"
            )
        for name, size in value.items():
            _check_override(name, size)
        if "preset" in info.data:
            sizes = {**LM_PRESETS[info.data["preset"]], **value}
            if sizes["d_model"] % sizes["n_heads"]:
                raise ValueError(f"d_model ({sizes['d_model']}) must be a multiple of n_heads ({sizes['n_heads']})")
        return value

    @field_validator("segment", mode="before")
    @classmethod
    def _valid_segment(cls, value):
        if isinstance(value, str):
            value = {"kind": value}
        if isinstance(value, dict):
            try:
                SegmentConfig(**value)
            except TypeError as exc:
                raise ValueError(f"unknown segment field ({exc}); expected kind, length, segments, memory, bptt") from None
            for name in ("length", "segments", "memory", "bptt"):
                if isinstance(value.get(name), int) and value[name] > MAX_LENGTH:
                    raise ValueError(f"segment.{name}: expected at most {MAX_LENGTH}, got {value[name]}")
        return value

    @property
    def head_width(self) -> int:
        """d_key of the model (d_model / n_heads), to check the variants against."""
        sizes = {**LM_PRESETS[self.preset], **self.model_overrides}
        return sizes["d_model"] // sizes["n_heads"]
