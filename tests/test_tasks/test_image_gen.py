"""Autoregressive image generation (Katharopoulos et al. 2020, §4.2): loaders, bits/dim,
generation through the step against the parallel form, the ci preset."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import torch
from helpers import attnbench

from harness.models import DecoderConfig
from harness.models.decoder import DecoderLM
from harness.scenarios.scenario import load_scenario
from harness.tasks.image_gen import LEVELS, START, bits_per_dim, generate, generation_speed, gumbel, levels, score_bits_per_dim, shifted
from harness.tasks.images import ImageFileError, load, read_cifar_binary, read_idx_images


def write_idx(path, images: np.ndarray, magic: int = 0x00000803) -> None:
    count, rows, columns = images.shape
    path.write_bytes(np.array([magic, count, rows, columns], dtype=">u4").tobytes() + images.astype(np.uint8).tobytes())


def test_idx_images_read_back(tmp_path, seed):
    images = np.random.default_rng(seed).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", images)
    assert np.array_equal(read_idx_images(tmp_path / "train-images-idx3-ubyte"), images.reshape(5, 784)), f"seed={seed}"
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as stream:
        stream.write((tmp_path / "train-images-idx3-ubyte").read_bytes())
    assert np.array_equal(load("mnist", "test", tmp_path), images.reshape(5, 784)), f"the .gz file is read, seed={seed}"


def test_malformed_idx_files_name_the_file_and_field(tmp_path):
    images = np.zeros((2, 4, 4), dtype=np.uint8) + 7
    write_idx(bad := tmp_path / "labels", images, magic=0x00000801)
    with pytest.raises(ImageFileError, match=r"labels: magic: expected 0x00000803"):
        read_idx_images(bad)
    write_idx(short := tmp_path / "short", images)
    short.write_bytes(short.read_bytes()[:-1])
    with pytest.raises(ImageFileError, match=r"short: pixels: .*need 48 bytes, the file has 47"):
        read_idx_images(short)
    (tiny := tmp_path / "tiny").write_bytes(b"\x00\x00\x08")
    with pytest.raises(ImageFileError, match="tiny: header"):
        read_idx_images(tiny)
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load("mnist", "train", tmp_path)


def write_cifar(path, labels, planes) -> None:
    """planes: [N, 3, 32, 32] uint8, written as the binary version's records."""
    records = [bytes([label]) + plane.astype(np.uint8).tobytes() for label, plane in zip(labels, planes)]
    path.write_bytes(b"".join(records))


def test_cifar_binary_records_read_in_raster_order_rgb_per_pixel(tmp_path, seed):
    rng = np.random.default_rng(seed)
    planes = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    write_cifar(tmp_path / "test_batch.bin", [0, 9, 3, 5], planes)
    images = read_cifar_binary(tmp_path / "test_batch.bin")
    assert images.shape == (4, 3072), f"seed={seed}"
    for n, row, column, channel in [(0, 0, 0, 0), (1, 5, 7, 2), (3, 31, 31, 1), (2, 10, 0, 1)]:
        assert images[n, 3 * (row * 32 + column) + channel] == planes[n, channel, row, column], f"seed={seed}"
    assert np.array_equal(load("cifar10", "test", tmp_path), images), f"seed={seed}"


def test_malformed_cifar_files_name_the_file_and_field(tmp_path):
    planes = np.ones((2, 3, 32, 32), dtype=np.uint8)
    write_cifar(bad := tmp_path / "data_batch_1.bin", [1, 2], planes)
    bad.write_bytes(bad.read_bytes()[:-5])
    with pytest.raises(ImageFileError, match=r"data_batch_1.bin: records: expected a whole number of 3073-byte records"):
        read_cifar_binary(bad)
    write_cifar(label := tmp_path / "test_batch.bin", [1, 10], planes)
    with pytest.raises(ImageFileError, match=r"test_batch.bin: label of record 1: expected a class 0..9, got 10"):
        read_cifar_binary(label)
    with pytest.raises(ValueError, match="data_dir"):
        load("cifar10", "train")


def test_digits_are_split_and_mapped_to_levels():
    pytest.importorskip("sklearn")
    train, test = load("digits", "train"), load("digits", "test")
    assert train.shape == (1500, 64) and test.shape == (297, 64) and train.dtype == np.uint8
    assert set(np.unique(np.concatenate([train, test]))) <= {round(v * 255 / 16) for v in range(17)}
    assert train.max() == 255 and train.min() == 0


def test_a_uniform_model_scores_exactly_8_bits_per_dimension(seed):
    images = torch.randint(0, LEVELS, (3, 10), generator=torch.Generator().manual_seed(seed))
    uniform = torch.full((3, 10, LEVELS + 1), 0.3, dtype=torch.float64)
    uniform[..., START] = 50.0  # the start token's logit is dropped, whatever it is
    assert bits_per_dim(uniform, images).item() == pytest.approx(8.0, abs=1e-12), f"seed={seed}"


def test_bits_per_dim_is_the_mean_negative_log2_likelihood(seed):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, LEVELS, (2, 5), generator=generator)
    logits = torch.randn(2, 5, LEVELS + 1, generator=generator, dtype=torch.float64)
    probabilities = torch.softmax(logits[..., :LEVELS], -1)
    expected = -sum(math.log2(probabilities[b, t, images[b, t]].item()) for b in range(2) for t in range(5)) / 10
    assert bits_per_dim(logits, images).item() == pytest.approx(expected, rel=1e-6), f"seed={seed}"


VARIANTS = [("softmax", {}), ("linear", {}), ("lsh", {"n_rounds": 2, "n_buckets": 4, "chunk_size": 16}), ("delta", {})]


def tiny_model(variant, params, pixels=12) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=LEVELS + 1, n_layers=2, d_model=16, n_heads=2, d_ff=32, context=pixels, variant=variant, variant_params=params, tie_embeddings=False
    )
    return DecoderLM(config).double().eval()


def test_scored_bits_per_dim_weighs_every_pixel_the_same(seed):
    model = tiny_model("linear", {})
    images = torch.randint(0, LEVELS, (7, 12), generator=torch.Generator().manual_seed(seed))
    whole = bits_per_dim(model(shifted(images)), images).item()
    assert score_bits_per_dim(model, images, batch=3) == pytest.approx(whole, rel=1e-9), f"seed={seed}"
    assert shifted(images)[:, 0].eq(START).all() and torch.equal(shifted(images)[:, 1:], images[:, :-1])


@pytest.mark.parametrize("variant, params", VARIANTS, ids=[name for name, _ in VARIANTS])
def test_generation_through_the_step_is_the_parallel_forms_sample(variant, params, seed):
    """Pixel t sampled through the step is argmax(logits_t + g_t) of the parallel forward over the
    generated image, with the same Gumbel noise (and the greedy argmax without noise)."""
    model = tiny_model(variant, params)
    noise = gumbel((3, 12, LEVELS), torch.Generator().manual_seed(seed), dtype=torch.float64)
    with torch.no_grad():
        images = generate(model, 12, noise)
        assert torch.equal((levels(model(shifted(images))) + noise).argmax(-1), images), f"seed={seed}"
        greedy = generate(model, 12, None, batch=2)
        assert torch.equal(levels(model(shifted(greedy))).argmax(-1), greedy), f"seed={seed}"
    assert len(set(map(tuple, images.tolist()))) > 1, f"different noise, different images, seed={seed}"


def test_generation_speed_reports_consistent_figures():
    speed = generation_speed(tiny_model("linear", {}, pixels=8).float(), 8, batch=2, repeats=2, seed=0)
    assert speed["min_s"] <= speed["median_s"] <= speed["max_s"] and speed["repeats"] == 2
    assert speed["images_per_s"] == pytest.approx(2 / speed["median_s"]) and speed["s_per_image"] == pytest.approx(speed["median_s"] / 2)


@pytest.mark.slow
def test_ci_preset_runs_through_attnbench_run(tmp_path):
    pytest.importorskip("sklearn")
    from harness.results import load as load_results

    done = attnbench("run", "quality/image-gen", "--preset", "ci", "--out", str(tmp_path / "out"), "--no-progress", "--report", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr
    table = load_results([tmp_path / "out"])
    assert sorted(table["variant"]) == ["linear", "lsh", "softmax"] and set(table["status"]) == {"ok"}, table[["variant", "error"]]
    assert table["metrics.bits_per_dim"].between(0, 20).all() and (table["metrics.images_per_s"] > 0).all()
    assert (table["metrics.speed.16.pixels"] == 16).all() and (table["metrics.generation.pixels"] == 64).all()
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Image generation" in page and "× softmax @ 16" in page


def test_the_cpu_preset_compares_softmax_linear_lsh_and_delta():
    """A preset's ``variants`` replace the scenario's: the cpu preset must list every compared variant."""
    assert {cell.variant for cell in load_scenario("quality/image-gen", preset="cpu").cells()} == {"softmax", "linear", "lsh", "delta"}
