"""The ``task:`` section of an image-generation scenario (``harness.tasks.image_gen`` trains it),
torch-free so that a scenario is checked before torch loads."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from . import MAX_BATCH, MAX_LAYERS, MAX_LENGTH, MAX_STEPS, MAX_WIDTH, Seed, Steps, TaskConfig
from .images import DATASETS


class ImageGenConfig(TaskConfig):
    """A scenario's ``task:`` section for autoregressive image generation (§4.2)."""

    name: Literal["image-gen"]
    dataset: Literal[DATASETS] = "digits"
    data_dir: str | None = Field(None, description="the directory of the MNIST IDX or CIFAR-10 binary files")
    n_layers: int = Field(8, ge=1, le=MAX_LAYERS)
    n_heads: int = Field(8, ge=1, le=MAX_LAYERS)
    d_ff: int | None = Field(None, ge=1, le=MAX_WIDTH, description="default 4 d_model")
    batch: int = Field(32, ge=1, le=MAX_BATCH)
    steps: Steps = 10000
    lr: float = Field(1e-4, gt=0)
    lr_drop_step: Steps | None = None
    log_every: Steps = 50
    test_images: int | None = Field(None, ge=1, description="score the first this many test images (default all)")
    gen_batch: int = Field(16, ge=1, le=MAX_BATCH, description="images generated at once when timing generation")
    gen_repeats: int = Field(3, ge=1, le=MAX_STEPS)
    speed_pixels: list[Annotated[int, Field(ge=1, le=MAX_LENGTH)]] = Field([784, 3072], description="lengths also timed with untrained weights")
    seed: Seed = 0
