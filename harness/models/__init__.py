"""Every model attnbench trains or measures, in one room, each around ``variants.AttentionLayer``
(or a bare core) so that any registered variant drops in by name:

- ``decoder``: ``DecoderLM``, the decoder-only Transformer of the ``model`` speed target and
  of the language-modelling, copy and image-generation tasks (with segment recurrence);
- ``configs``: its sizes, presets and segment settings (``DecoderConfig``, ``LM_PRESETS``,
  ``SegmentConfig``), torch-free and re-exported here, so that a scenario is checked before
  torch loads (importing this package loads no torch);
- ``seq2seq``: ``Seq2Seq``, the encoder-decoder Transformer of translation;
- ``mqar``: ``MQARModel``, the Zoology-style stack of multi-query associative recall;
- ``retrieval``: ``RetrievalModel``, the single fast-weight memory of associative retrieval.

The tasks that train them are in ``harness.tasks``.

May import: variants, tasks (the translation vocabulary's ids).
"""

from __future__ import annotations

from .configs import LM_PRESETS, SEGMENT_KINDS, DecoderConfig, SegmentConfig, config_from_preset, lm_config

__all__ = ["LM_PRESETS", "SEGMENT_KINDS", "DecoderConfig", "SegmentConfig", "check_positive_int", "config_from_preset", "lm_config"]


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
