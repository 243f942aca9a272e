"""Image data for autoregressive generation (Katharopoulos et al. 2020, §4.2), as ``uint8``
pixel sequences ``[N, P]`` in raster order, 256 intensity levels.

- ``digits``: the 1,797 8×8 digits shipped in scikit-learn (``sklearn.datasets.load_digits``,
  the optional extra ``attnbench[images]``). Their values 0 .. 16 map to levels
  round(v · 255 / 16), so 17 of the 256 levels occur. Split: a fixed shuffle (seed 0), the
  last 297 images for test, 1,500 for training.
- ``mnist``: the IDX files ``train-images-idx3-ubyte`` and ``t10k-images-idx3-ubyte`` (or the
  same names with ``.gz``) in a directory; 784 pixels.
- ``cifar10``: the binary version's ``data_batch_1.bin`` .. ``data_batch_5.bin`` and
  ``test_batch.bin`` (records of 1 label byte and 3,072 pixel bytes: 1,024 red, 1,024 green,
  1,024 blue, each 32×32 row-major); the sequence is raster order over pixels with each
  pixel's red, green and blue in turn, 3,072 values. The pickled "python version" is never read.

A malformed file raises ``ImageFileError`` naming the file, the field and what was expected.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

DATASETS = ("digits", "mnist", "cifar10")
DIGITS_TEST = 297
#: IDX magic of an unsigned-byte array of 3 dimensions (images); 0x0801 is the labels' 1-D array.
IDX_UBYTE_3D = 0x00000803
MNIST_FILES = {"train": "train-images-idx3-ubyte", "test": "t10k-images-idx3-ubyte"}
CIFAR_FILES = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
CIFAR_RECORD = 1 + 3 * 32 * 32


class ImageFileError(ValueError):
    """A data file that is not in the format its loader reads."""


def pixels(dataset: str) -> int:
    """The sequence length of an image of ``dataset``."""
    return {"digits": 64, "mnist": 784, "cifar10": 3072}[dataset]


def load(dataset: str, split: str, data_dir: str | Path | None = None) -> np.ndarray:
    """The ``split`` ('train' or 'test') of ``dataset`` as ``uint8 [N, pixels]``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if dataset == "digits":
        return _digits(split)
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if data_dir is None:
        raise ValueError(f"dataset {dataset!r} is read from a local directory: set data_dir")
    directory = Path(data_dir)
    if dataset == "mnist":
        return read_idx_images(_existing(directory, MNIST_FILES[split], gz=True))
    return np.concatenate([read_cifar_binary(_existing(directory, name)) for name in CIFAR_FILES[split]])


def _digits(split: str) -> np.ndarray:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the digits data set needs scikit-learn: pip install 'attnbench[images]'") from None
    levels = np.rint(load_digits().data * 255 / 16).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(levels))
    return levels[order[-DIGITS_TEST:]] if split == "test" else levels[order[:-DIGITS_TEST]]


def _existing(directory: Path, name: str, gz: bool = False) -> Path:
    candidates = [directory / name] + ([directory / f"{name}.gz"] if gz else [])
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"{candidates[0]}: not found{' (nor ' + candidates[1].name + ')' if gz else ''}")


def _read_bytes(path: Path) -> bytes:
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as stream:
        return stream.read()


def read_idx_images(path: str | Path) -> np.ndarray:
    """An IDX file of unsigned-byte images (magic 0x00000803, then N, rows, columns as big-endian
    int32, then the pixels) as ``uint8 [N, rows·columns]``."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 16:
        raise ImageFileError(f"{path}: header: expected 16 bytes (magic, count, rows, columns), the file has {len(data)}")
    magic, count, rows, columns = np.frombuffer(data[:16], dtype=">u4")
    if magic != IDX_UBYTE_3D:
        raise ImageFileError(f"{path}: magic: expected 0x{IDX_UBYTE_3D:08x} (unsigned bytes, 3 dimensions), got 0x{int(magic):08x}")
    expected = 16 + int(count) * int(rows) * int(columns)
    if len(data) != expected:
        raise ImageFileError(f"{path}: pixels: the header's {count}×{rows}×{columns} images need {expected} bytes, the file has {len(data)}")
    return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(int(count), int(rows) * int(columns))


def read_cifar_binary(path: str | Path) -> np.ndarray:
    """A CIFAR-10 binary batch (records of 1 label byte + 3,072 pixel bytes) as ``uint8 [N, 3072]``
    in raster order, each pixel's R, G, B in turn."""
    path = Path(path)
    data = _read_bytes(path)
    if not data or len(data) % CIFAR_RECORD:
        raise ImageFileError(f"{path}: records: expected a whole number of {CIFAR_RECORD}-byte records (1 label + 3072 pixels), the file has {len(data)} bytes")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR_RECORD)
    labels = records[:, 0]
    if labels.max() > 9:
        bad = int(np.argmax(labels > 9))
        raise ImageFileError(f"{path}: label of record {bad}: expected a class 0..9, got {int(labels[bad])}")
    return np.ascontiguousarray(records[:, 1:].reshape(-1, 3, 1024).transpose(0, 2, 1).reshape(-1, 3072))
