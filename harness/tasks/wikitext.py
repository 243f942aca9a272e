"""WikiText (Merity et al. 2016), word level, in its standard layout.

A directory holding ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``
(WikiText-2 or WikiText-103). Each line is split on whitespace and ends with one ``<eos>``
(an empty line gives a lone ``<eos>``), so a split is one stream of tokens. The vocabulary
comes from the training split, most frequent first (ties in order of first appearance);
``<unk>`` is an ordinary token of the files. A valid or test word outside the training
vocabulary (none in WikiText) is read as ``<unk>``.

Reading WikiText-103 takes minutes, so the token ids are cached in
``$XDG_CACHE_HOME/attnbench`` (``~/.cache/attnbench``), keyed by the files' paths, sizes and
modification times; a changed file is read again.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from .download import DataError, dataset_dir

EOS, UNK = "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")


def split_path(directory: Path, split: str) -> Path:
    return Path(directory) / f"wiki.{split}.tokens"


def read_words(path) -> list[str]:
    """The words of a WikiText file: each line's whitespace-separated words, then ``<eos>``."""
    words = []
    with open(path, encoding="utf-8") as f:
        try:
            for line in f:
                words.extend(line.split())
                words.append(EOS)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason})") from None
    return words


@dataclass
class WikiText:
    """The vocabulary (``vocab[i]`` is token i) and each split as a 1-D long tensor of ids."""

    directory: Path
    vocab: list[str]
    splits: dict[str, torch.Tensor]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def __getitem__(self, split: str) -> torch.Tensor:
        if split not in self.splits:
            raise KeyError(f"no split {split!r}; splits: {', '.join(self.splits)}")
        return self.splits[split]

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the training split's unigram distribution: the cross-entropy per
        token of the best model that ignores context, a baseline any LM must beat."""
        counts = torch.bincount(self.splits["train"], minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log()).sum())


def build_vocab(words: list[str]) -> list[str]:
    """Tokens by descending count, ties in order of first appearance (Counter keeps insertion order)."""
    return [word for word, _ in Counter(words).most_common()]


def load_wikitext(directory=None, name: str = "wikitext-2") -> WikiText:
    """Load a WikiText directory: ``directory``, else ``$ATTNBENCH_DATA/<name>``, else the shared
    data (``harness.tasks.download.dataset_dir``); an incomplete one is a DataError naming it."""
    directory = dataset_dir(name, directory).resolve()
    cache = _cache_path(directory)
    if cache.is_file():
        cached = torch.load(cache, weights_only=True)
        return WikiText(directory, cached["vocab"], cached["splits"])
    corpus = _read(directory)
    cache.parent.mkdir(parents=True, exist_ok=True)
    temporary = cache.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"vocab": corpus.vocab, "splits": corpus.splits}, temporary)
    os.replace(temporary, cache)
    return corpus


def _cache_path(directory: Path) -> Path:
    """The cache file of ``directory``: a hash of each split file's path, size and mtime."""
    key = hashlib.sha256()
    for split in SPLITS:
        stat = split_path(directory, split).stat()
        key.update(f"{split_path(directory, split)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnbench"
    return root / f"wikitext-{key.hexdigest()[:20]}.pt"


def _read(directory: Path) -> WikiText:
    """Tokenise the three splits of ``directory`` (see the module docstring)."""
    words = {split: read_words(split_path(directory, split)) for split in SPLITS}
    vocab = build_vocab(words["train"])
    index = {word: i for i, word in enumerate(vocab)}
    unk = index.get(UNK)
    splits = {}
    for split, tokens in words.items():
        missing = [word for word in tokens if word not in index]
        if missing and unk is None:
            raise ValueError(f"{split_path(directory, split)}: {len(missing)} words outside the training vocabulary "
                             f"(e.g. {missing[0]!r}) and no {UNK} token to map them to")
        splits[split] = torch.tensor([index.get(word, unk) for word in tokens], dtype=torch.long)
    return WikiText(directory, vocab, splits)

