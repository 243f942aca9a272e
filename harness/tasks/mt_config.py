"""The settings of a translation run, ``MTConfig``: a scenario's ``task:`` section and the settings options of
``python -m harness.tasks.mt`` (``harness.tasks.mt`` trains it), with the presets (``PRESETS``) and data sets
(``DATASETS``) they name; torch-free so that a scenario is checked before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, field_validator

from variants.params import variant_names

from . import MAX_LAYERS, MAX_LENGTH, MAX_VOCAB, Seed, Steps, TaskConfig, one_of


@dataclass(frozen=True)
class Dataset:
    """Where a data set's splits are: ``directory`` (a name under ``data_root()`` or a path),
    the training, validation (optional) and test splits, and where the test split lives when
    it is not in ``directory`` (the shared newstest2014 beside a user's WMT14 training data)."""

    directory: str
    train: str
    valid: str | None
    test: str
    test_directory: str | None = None


DATASETS = {
    "multi30k": Dataset("multi30k", "train", "val", "test_2016_flickr"),
    "wmt14": Dataset("wmt14", "train", "newstest2013", "newstest2014", test_directory="wmt14-newstest2014"),
}

#: Every preset of a run, in one table: the model's sizes (``Seq2SeqConfig`` fields) and the
#: values of the run settings an ``MTConfig`` leaves None. "ci" runs in seconds; "cpu" trains in
#: about 5-6 minutes on one CPU thread (docs/translation.md); "gpu" is a Multi30k-sized model (3 + 3
#: layers of width 256, as common small Multi30k baselines); "base" is the Transformer base of
#: Vaswani et al. 2017 for WMT14 (100k steps of 25k tokens, beam 4; batch_tokens is per rank).
PRESETS: dict[str, dict[str, dict]] = {
    "ci": {
        "model": dict(encoder_layers=1, decoder_layers=1, d_model=32, n_heads=2, d_ff=64, dropout=0.0),
        "run": dict(steps=40, batch_tokens=600, lr=3e-3, warmup=10, beam=2, vocab_size=1000, max_sentences=200, test_sentences=16),
    },
    "cpu": {
        "model": dict(encoder_layers=2, decoder_layers=2, d_model=128, n_heads=4, d_ff=512, dropout=0.1),
        "run": dict(steps=700, batch_tokens=2000, lr=2e-3, warmup=70, beam=4, vocab_size=4000, max_sentences=None, test_sentences=None),
    },
    "gpu": {
        "model": dict(encoder_layers=3, decoder_layers=3, d_model=256, n_heads=8, d_ff=1024, dropout=0.1),
        "run": dict(steps=15000, batch_tokens=8000, lr=1e-3, warmup=1000, beam=5, vocab_size=8000, max_sentences=None, test_sentences=None),
    },
    "base": {
        "model": dict(encoder_layers=6, decoder_layers=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1),
        "run": dict(steps=100000, batch_tokens=25000, lr=7e-4, warmup=4000, beam=4, vocab_size=32000, max_sentences=None, test_sentences=None),
    },
}


class MTConfig(TaskConfig):
    """Every setting of a translation run, with its default: a scenario's ``task:`` section, the
    settings options of ``python -m harness.tasks.mt`` and what ``run_mt`` takes. A setting left
    None takes the preset's value (``PRESETS``; ``resolved``)."""

    name: Literal["mt"] = "mt"
    preset: Annotated[str, one_of(PRESETS, "a preset")] = Field(
        "cpu", description=f"model sizes and the values of the settings left none: one of {', '.join(PRESETS)}"
    )
    dataset: Annotated[str, one_of(DATASETS, "a data set")] = Field("multi30k", description=f"the data set: one of {', '.join(DATASETS)}")
    data: str | None = Field(None, description="the data set's directory (none: the shared data, or $ATTNBENCH_DATA)")
    steps: Steps | None = Field(None, description="optimiser steps (none: the preset's)")
    batch_tokens: int | None = Field(None, ge=1, le=MAX_LENGTH, description="padded tokens per batch and process (none: the preset's)")
    lr: float | None = Field(None, gt=0, description="peak learning rate, AdamW (none: the preset's)")
    warmup: int | None = Field(None, ge=0, validate_default=True, description="steps of linear warm-up, at most steps (none: the preset's)")
    beam: int | None = Field(None, ge=1, le=MAX_LAYERS, description="beam width, 1 for greedy decoding (none: the preset's)")
    length_penalty: float = Field(1.0, ge=0, description="beam search ranks hypotheses by log p / length^length_penalty")
    vocab_size: int | None = Field(None, ge=300, le=MAX_VOCAB, description="joint sentencepiece vocabulary (none: the preset's)")
    max_sentences: int | None = Field(None, ge=1, description="train on the first N pairs (none: the preset's; ci 200, the others all)")
    test_sentences: int | None = Field(None, ge=1, description="translate the first N test sentences (none: the preset's; ci 16, the others all)")
    eval_every: Steps | None = Field(None, description="steps between validation losses (none: at the end only)")
    encoder: str | None = Field(None, description="variant of encoder self-attention (none: the run's variant, or fallback)")
    cross: str | None = Field(None, description="variant of cross-attention (none: the run's variant, or fallback)")
    fallback: str = Field("linear", description="encoder and cross variant when the run's variant is causal only")
    threads: int | None = Field(None, ge=1, le=MAX_LAYERS, description="torch CPU threads (none: torch's default)")
    seed: Seed = Field(0, description="seed of the initialisation, the batches and dropout")

    @field_validator("warmup")
    @classmethod
    def _warmup_within_steps(cls, value, info):
        if "preset" in info.data and "steps" in info.data:
            run = PRESETS[info.data["preset"]]["run"]
            warmup, steps = run["warmup"] if value is None else value, info.data["steps"] or run["steps"]
            if warmup > steps:
                preset_s = "" if value is not None else f"the preset's warm-up, {warmup}, "
                raise ValueError(f"{preset_s}must be at most steps = {steps}")
        return value

    @field_validator("encoder", "cross", "fallback")
    @classmethod
    def _known_variant(cls, value):
        if value is not None and value not in variant_names():
            raise ValueError(f"unknown variant {value!r}; known: {', '.join(variant_names())}")
        return value

    @property
    def head_width(self) -> int:
        """d_key of the preset's model (d_model / n_heads), to check the variants against."""
        sizes = PRESETS[self.preset]["model"]
        return sizes["d_model"] // sizes["n_heads"]

    def resolved(self) -> MTConfig:
        """This config with every setting left None that the preset has filled in from ``PRESETS``."""
        return self.model_copy(update={key: value for key, value in PRESETS[self.preset]["run"].items() if getattr(self, key) is None})
