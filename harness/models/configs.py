"""The sizes of the decoder-only Transformer (``harness.models.decoder``) and its presets, torch-free so
that a scenario's model and task sections are checked before torch loads: ``DecoderConfig``, the
segment-level recurrence's ``SegmentConfig``, ``LM_PRESETS`` and ``lm_config``; ``config_from_preset``
serves the translation model's presets too."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

SEGMENT_KINDS = ("none", "xl", "rmt", "carry_state")


@dataclass(frozen=True)
class SegmentConfig:
    """Segment-level recurrence (docs/language-modelling.md, "Segment models").

    ``kind``: ``none``; ``xl`` (Transformer-XL: every layer also attends to the previous
    segment's cached, detached layer inputs; softmax only); ``rmt`` (Recurrent Memory
    Transformer: ``memory`` tokens read at the start of a segment and written at its end);
    ``carry_state`` (linear-time variants: each layer's fast-weight state carried over).
    ``length``: tokens per segment (None: the run's context); ``segments``: consecutive segments
    per training sample; ``bptt``: segments that gradients flow through (None: all of a sample;
    the carried memory/state is detached at the start of every group of ``bptt`` segments;
    ``xl`` always detaches, so it takes only None or 1)."""

    kind: str = "none"
    length: int | None = None
    segments: int = 2
    memory: int = 0
    bptt: int | None = None

    def __post_init__(self):
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment.kind must be one of {', '.join(SEGMENT_KINDS)}, got {self.kind!r}")
        for name, minimum, optional in (("length", 1, True), ("segments", 1, False), ("memory", 0, False), ("bptt", 1, True)):
            value = getattr(self, name)
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"segment.{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}")
        if (self.kind == "rmt") != (self.memory > 0):
            raise ValueError(f"segment.memory: rmt needs memory >= 1 tokens and the other kinds take 0; got memory={self.memory} for kind={self.kind!r}")
        if self.kind == "xl" and self.bptt not in (None, 1):
            raise ValueError(f"segment.bptt: Transformer-XL's cache is always detached (bptt 1 or None), got {self.bptt}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def positions(self) -> int:
        """Positions a segment occupies: its tokens, and for ``rmt`` the read and write memory."""
        return self.length + 2 * self.memory


@dataclass
class DecoderConfig:
    """Sizes of a DecoderLM. ``variant`` names the attention core, ``variant_params`` go to it
    (and to ``AttentionLayer``: e.g. ``d_key``, ``chunk_size``, ``phi``)."""

    vocab_size: int
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    context: int
    dropout: float = 0.0
    variant: str = "softmax"
    variant_params: dict = field(default_factory=dict)
    tie_embeddings: bool = True
    adaptive_cutoffs: tuple[int, ...] | None = None
    adaptive_div_value: float = 4.0
    segment: SegmentConfig | None = None


#: Model sizes without the vocabulary. "small" and "medium" are the WikiText-103 language
#: models of Schlag et al. 2021, §6.3; "cpu" is small enough to train on two CPU cores.
LM_PRESETS: dict[str, dict] = {
    "small": dict(n_layers=16, d_model=128, n_heads=8, d_ff=2048, context=256),
    "medium": dict(n_layers=16, d_model=256, n_heads=8, d_ff=4096, context=384),
    "cpu": dict(n_layers=2, d_model=128, n_heads=4, d_ff=512, context=128),
}


def lm_config(preset: str, vocab_size: int, **overrides) -> DecoderConfig:
    """The DecoderConfig of a preset (see ``LM_PRESETS``) for ``vocab_size``, with ``overrides``
    (any DecoderConfig field, e.g. ``variant="delta"``, ``dropout=0.1``)."""
    return config_from_preset(DecoderConfig, LM_PRESETS, "LM", preset, vocab_size, overrides)


def config_from_preset(config_class, presets: dict, label: str, preset: str, vocab_size: int, overrides: dict):
    """``config_class(vocab_size, **presets[preset])`` with ``overrides`` (any other field);
    an unknown preset or field is an error that lists the known ones (LM and MT configs)."""
    if preset not in presets:
        raise ValueError(f"unknown {label} preset {preset!r}; known presets: {', '.join(presets)}")
    known = {f.name for f in fields(config_class)} - {"vocab_size"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown {config_class.__name__} override(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
    return replace(config_class(vocab_size=vocab_size, **presets[preset]), **overrides)
