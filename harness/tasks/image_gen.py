"""Autoregressive image generation, Katharopoulos et al. 2020 (§4.2, Tables 2 and 3).

Pixels are predicted one by one in raster order (``harness.tasks.images``): a categorical
distribution over 256 intensity levels per pixel (not the paper's mixture of logistics). The
model is ``harness.models.decoder.DecoderLM`` over the 257 tokens of the levels and a start token: the
input is [START, p_1 .. p_{P−1}], the targets p_1 .. p_P, and the start token's logit is
dropped from every prediction (``levels``). Training: RAdam with a tenfold learning-rate drop
(``harness.tasks.training.TrainConfig.loss_curve``). Metrics:

- ``bits_per_dim``: the mean negative log₂-likelihood per pixel of the test images (a uniform
  model scores exactly 8);
- generation through each variant's recurrent step (``DecoderLM.step``: softmax and LSH with
  their cache of every past key, the linear-time rules with their fixed-size state), one
  batch of ``gen_batch`` images sampled pixel by pixel: ``images_per_s`` and
  ``s_per_image`` (median over ``gen_repeats`` timed generations, after a short warm-up), at
  the data's length with the trained weights, and at each of ``speed_pixels`` (784 and 3,072,
  the MNIST and CIFAR-10 lengths) with an untrained model of the same shape: the time of a
  step does not depend on the weights' values, only on the shapes.

Sampling is Gumbel-max with noise drawn up front (``gumbel``): pixel t is
argmax(logits_t + g_t), the same draw a parallel forward over the generated image gives, so
the step and the parallel form can be checked against each other exactly.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from ..models import DecoderConfig
from ..models.decoder import DecoderLM
from .batches import GeneratorBatches
from .image_gen_config import ImageGenConfig
from .images import load, pixels
from .precision import Precision
from .training import TrainConfig, train

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

LEVELS = 256
START = LEVELS  # the start token's id


def levels(logits: torch.Tensor) -> torch.Tensor:
    """The logits of the 256 intensity levels (the start token's dropped)."""
    return logits[..., :LEVELS]


def shifted(images: torch.Tensor) -> torch.Tensor:
    """The model's inputs for ``images [B, P]`` (long): [START, p_1 .. p_{P−1}]."""
    return torch.cat([torch.full_like(images[:, :1], START), images[:, :-1]], 1)


def bits_per_dim(logits: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """Mean −log₂ p(pixel) over ``images [B, P]`` under ``logits [B, P, ≥256]``."""
    scores = levels(logits).flatten(0, 1)
    return F.cross_entropy(scores.to(torch.promote_types(scores.dtype, torch.float32)), images.flatten()) / math.log(2)


def image_loss(model: DecoderLM, images: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Training loss (nats per pixel) of a batch and its number of pixels."""
    return bits_per_dim(model(shifted(images)), images) * math.log(2), images.numel()


@torch.no_grad()
def score_bits_per_dim(model: DecoderLM, images: torch.Tensor, batch: int) -> float:
    """Bits per dimension over all of ``images`` (every pixel weighs the same)."""
    total = 0.0
    for start in range(0, len(images), batch):
        chunk = images[start : start + batch]
        total += bits_per_dim(model(shifted(chunk)), chunk).item() * chunk.numel()
    return total / images.numel()


def gumbel(shape, generator: torch.Generator, device=None, dtype=torch.float32) -> torch.Tensor:
    """Standard Gumbel noise −log(−log U) of ``shape``."""
    uniform = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(uniform))).to(device=device, dtype=dtype)


@torch.no_grad()
def generate(model: DecoderLM, n_pixels: int, noise: torch.Tensor | None, batch: int | None = None) -> torch.Tensor:
    """``[B, n_pixels]`` images sampled through ``model.step``: pixel t is argmax(levels(logits_t) +
    noise[:, t]) (``noise [B, P, 256]``, Gumbel: a sample; None: the greedy argmax, ``batch`` rows)."""
    rows = noise.shape[0] if noise is not None else batch
    device = model.embed.weight.device
    states = model.init_state(rows)
    token = torch.full((rows,), START, dtype=torch.long, device=device)
    image = torch.empty(rows, n_pixels, dtype=torch.long, device=device)
    for t in range(n_pixels):
        logits, states = model.step(token, t, states)
        scores = levels(logits) if noise is None else levels(logits) + noise[:, t]
        token = image[:, t] = scores.argmax(-1)
    return image


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generation_speed(model: DecoderLM, n_pixels: int, batch: int, repeats: int, seed: int) -> dict:
    """Seconds to sample ``batch`` images of ``n_pixels`` through the step (median, min, max of
    ``repeats`` generations after a warm-up of min(16, n_pixels) pixels): ``images_per_s``, ``s_per_image``."""
    device = model.embed.weight.device
    noise = gumbel((batch, n_pixels, LEVELS), torch.Generator().manual_seed(seed), device=device, dtype=model.embed.weight.dtype)
    generate(model, min(16, n_pixels), noise[:, : min(16, n_pixels)])
    times = []
    for _ in range(repeats):
        _synchronize(device)
        started = time.perf_counter()
        generate(model, n_pixels, noise)
        _synchronize(device)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {
        "pixels": n_pixels,
        "batch": batch,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "repeats": repeats,
        "images_per_s": batch / median,
        "s_per_image": median / batch,
    }


def _model(variant: str, params: dict, config: ImageGenConfig, d_model: int, context: int, device) -> DecoderLM:
    return DecoderLM(
        DecoderConfig(
            vocab_size=LEVELS + 1,
            n_layers=config.n_layers,
            d_model=d_model,
            n_heads=config.n_heads,
            d_ff=config.d_ff or 4 * d_model,
            context=context,
            variant=variant,
            variant_params=params,
            tie_embeddings=False,
        )
    ).to(device)


def run_image_gen(variant: str, params: dict, config: ImageGenConfig, *, d_model: int, device="cpu", dtype: str = "float32") -> dict:
    """One cell: train on the data set's training images, score the test images, time generation
    (scoring and generation under the training's autocast, ``harness.tasks.precision``)."""
    train_images = torch.from_numpy(load(config.dataset, "train", config.data_dir).astype(np.int64))
    test_images = torch.from_numpy(load(config.dataset, "test", config.data_dir)[: config.test_images].astype(np.int64))
    n_pixels = pixels(config.dataset)
    torch.manual_seed(config.seed)
    model = _model(variant, params, config, d_model, n_pixels, device)
    batches = GeneratorBatches(lambda generator: train_images[torch.randint(len(train_images), (config.batch,), generator=generator)].to(device), config.seed)
    result = train(model, image_loss, batches, TrainConfig.loss_curve(config, dtype), progress=False)
    metrics = {
        "loss": result.losses[-1][1],
        "losses": [list(point) for point in result.losses],
        "steps": result.steps,
        "train_s": result.train_s,
        "words_per_s": result.units_per_s,
        "seed": config.seed,
        "num_parameters": model.num_parameters(),
    }
    if not math.isfinite(metrics["loss"]):
        return metrics
    with Precision(dtype, device).autocast():
        metrics["bits_per_dim"] = score_bits_per_dim(model, test_images.to(device), config.batch)
        own = generation_speed(model, n_pixels, config.gen_batch, config.gen_repeats, config.seed)
        metrics.update(images_per_s=own["images_per_s"], s_per_image=own["s_per_image"], generation=own)
        speed = {}
        for length in config.speed_pixels:
            torch.manual_seed(config.seed)
            untrained = _model(variant, params, config, d_model, length, device).eval()
            speed[str(length)] = generation_speed(untrained, length, config.gen_batch, config.gen_repeats, config.seed)
    metrics["speed"] = speed
    return metrics


def run_cell(cell: Cell) -> dict:
    """Train, score and time one cell (axis d_model)."""
    config = ImageGenConfig.model_validate(cell.task)
    params = dict(cell.params, backend=cell.backend)
    return run_image_gen(cell.variant, params, config, d_model=cell.axes["d_model"], device=cell.device, dtype=cell.axes["dtype"])
