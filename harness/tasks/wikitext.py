"""WikiText (Merity et al. 2016), word level, in its standard layout.

A directory holding ``wiki.train.tokens``, ``wiki.valid.tokens`` and ``wiki.test.tokens``
(WikiText-2 or WikiText-103). Each line is split on whitespace and ends with one ``<eos>``
(an empty line gives a lone ``<eos>``), so a split is one stream of tokens. The vocabulary
comes from the training split, most frequent first (ties in order of first appearance);
``<unk>`` is an ordinary token of the files. A valid or test word outside the training
vocabulary (none in WikiText) is read as ``<unk>``.

Reading WikiText-103 takes minutes, so the token ids are cached in
``$XDG_CACHE_HOME/attnbench`` (``~/.cache/attnbench``), keyed by what they were built from: the
SHA-256 of the three files' content and the tokenizer's settings (``TOKENIZER``), not their paths,
sizes or modification times. A cache that does not validate (``TokenCache``) or holds another key
is ignored with a warning and rebuilt (harness.common.caches).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ..common.caches import ignored, validated
from ..common.files import write_atomic
from .download import DataError, dataset_dir

EOS, UNK = "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")
#: How the files become token ids (``read_words``, ``build_vocab``, ``_read``): part of the cache's key.
TOKENIZER = {
    "words": "whitespace-separated, <eos> after each line",
    "eos": EOS,
    "unk": UNK,
    "vocab": "the training split's words by descending count, ties in order of first appearance",
    "ids": "int64",
}


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


def _token_ids(ids: torch.Tensor) -> torch.Tensor:
    if ids.dtype != torch.long or ids.dim() != 1:
        raise ValueError(f"expected a 1-D tensor of int64 token ids, got {ids.dtype} of shape {tuple(ids.shape)}")
    return ids


TokenIds = Annotated[torch.Tensor, AfterValidator(_token_ids)]


class TokenCache(BaseModel):
    """A token cache file: its ``key`` (``cache_key``), the vocabulary and each split's ids, all within the vocabulary."""

    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)
    key: str
    vocab: list[str] = Field(min_length=1)
    train: TokenIds
    valid: TokenIds
    test: TokenIds

    @model_validator(mode="after")
    def _within_vocab(self) -> TokenCache:
        for split in SPLITS:
            ids = getattr(self, split)
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < len(self.vocab):
                raise ValueError(f"{split}: token ids outside the vocabulary of {len(self.vocab)}")
        return self


def load_wikitext(directory=None, name: str = "wikitext-2") -> WikiText:
    """Load a WikiText directory: ``directory``, else ``$ATTNBENCH_DATA/<name>``, else the shared
    data (``harness.tasks.download.dataset_dir``); an incomplete one is a DataError naming it."""
    directory = dataset_dir(name, directory).resolve()
    key = cache_key(directory)
    path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnbench" / f"wikitext-{key[:20]}.pt"
    if (cached := _read_cache(path, key)) is not None:
        return WikiText(directory, cached.vocab, {split: getattr(cached, split) for split in SPLITS})
    corpus = _read(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = io.BytesIO()
    torch.save({"key": key, "vocab": corpus.vocab, **corpus.splits}, payload)
    write_atomic(path, payload.getbuffer())
    return corpus


def cache_key(directory: Path) -> str:
    """The SHA-256 of the tokenizer's settings and each split file's content: what the ids are built from."""
    key = hashlib.sha256(json.dumps(TOKENIZER, sort_keys=True).encode())
    for split in SPLITS:
        with open(split_path(directory, split), "rb") as file:
            key.update(f"{split}:{hashlib.file_digest(file, 'sha256').hexdigest()};".encode())
    return key.hexdigest()


def _read_cache(path: Path, key: str) -> TokenCache | None:
    """The cache at ``path`` if it is one of ``key``; None where there is none, or (with a warning) where it
    does not load as data, does not validate or was built from other files or settings."""
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every way a foreign or corrupt file fails to load is the same answer
        ignored(path, (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200])
        return None
    cached = validated(path, TokenCache, payload)
    if cached is not None and cached.key != key:
        ignored(path, "built from other files or tokenizer settings")
        return None
    return cached


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
            raise ValueError(
                f"{split_path(directory, split)}: {len(missing)} words outside the training vocabulary (e.g. {missing[0]!r}) and no {UNK} token to map them to"
            )
        splits[split] = torch.tensor([index.get(word, unk) for word in tokens], dtype=torch.long)
    return WikiText(directory, vocab, splits)
