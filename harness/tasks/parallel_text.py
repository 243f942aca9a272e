"""Parallel text in the standard ``{split}.{lang}`` layout, and its subword vocabulary.

A data set is a directory of line-aligned UTF-8 files, line i of ``{split}.{src}`` being the
translation of line i of ``{split}.{tgt}``: Multi30k task 1 (``train``, ``val``,
``test_2016_flickr`` in ``en``/``de``), WMT14 (``newstest2014``; a user's training data as
``train.en``/``train.de``), or any directory laid out the same way. Lines are split on
``\\n`` only and kept as they are (the references BLEU is scored against are the raw text).

The shared data live in ``<repo>/../shared/data/<name>/``; ``$ATTNBENCH_DATA`` names another
directory holding ``multi30k/``, ``wmt14-newstest2014/``, ...

The vocabulary is one joint sentencepiece model (Kudo & Richardson 2018) trained on both
sides of the training split: BPE (Sennrich et al. 2016; the default, and about 15 times faster
to train than unigram on Multi30k) or unigram (Kudo 2018), identity normalisation and byte
fall-back, so that ``decode(encode(s)) == s`` for any text. It is trained once into a cache
directory (``$ATTNBENCH_CACHE`` or ``~/.cache/attnbench``) keyed by the content of the
training files and the settings, never into the repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_TYPES = ("unigram", "bpe")
PAD, UNK, BOS, EOS = 0, 1, 2, 3
#: sentencepiece's trainer reads at most this many sentences (a random sample of larger corpora).
MAX_TRAINING_SENTENCES = 2_000_000
#: Bump when the trainer settings below change, so that old cached models are not reused.
_VOCAB_FORMAT = 1


class DataError(ValueError):
    """Missing or malformed parallel text: the message names the directory, split, language and file."""


def data_root() -> Path:
    """``$ATTNBENCH_DATA``, or the shared data next to the repository (``<repo>/../shared/data``)."""
    return Path(os.environ.get("ATTNBENCH_DATA") or REPO.parent / "shared" / "data")


def dataset_dir(name_or_path: str | os.PathLike) -> Path:
    """A data set directory: an existing path as given, else ``data_root() / name``."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    candidate = data_root() / path
    if candidate.is_dir():
        return candidate
    raise DataError(
        f"no parallel text directory {str(name_or_path)!r}: neither it nor {candidate} exists "
        f"(set ATTNBENCH_DATA to the directory holding {path.name}/, or give the data set's path)"
    )


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 file, split on ``\\n`` only (a ``\\r`` or form feed inside a line stays in it)."""
    with open(path, encoding="utf-8", newline="") as handle:  # no universal newlines: "\r" is not a line break
        try:
            text = handle.read()
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text (byte {exc.start:,}: {exc.reason})") from None
    return text.removesuffix("\n").split("\n") if text else []


@dataclass
class ParallelText:
    """Aligned ``sources[i]`` -> ``targets[i]`` of one split, with where they came from."""

    sources: list[str]
    targets: list[str]
    directory: Path
    split: str
    src_lang: str
    tgt_lang: str

    def __len__(self) -> int:
        return len(self.sources)


def split_path(directory: Path, split: str, lang: str) -> Path:
    """``directory/{split}.{lang}``, or a DataError that names the directory, split, language and what is there."""
    path = Path(directory) / f"{split}.{lang}"
    if not path.is_file():
        present = sorted(p.name for p in Path(directory).iterdir() if p.is_file()) if Path(directory).is_dir() else []
        raise DataError(
            f"{directory}: split {split!r}, language {lang!r}: missing file {path.name} "
            f"(expected line-aligned {split}.<lang> files; the directory holds: {', '.join(present) or 'nothing'})"
        )
    return path


def read_parallel(directory, split: str, src_lang: str = "en", tgt_lang: str = "de", *, limit: int | None = None) -> ParallelText:
    """The ``split`` of the data set at ``directory`` (a path or a name under ``data_root()``);
    ``limit`` keeps the first lines only. Files of different line counts are an error."""
    directory = dataset_dir(directory)
    paths = [split_path(directory, split, lang) for lang in (src_lang, tgt_lang)]
    sources, targets = (read_lines(path) for path in paths)
    if len(sources) != len(targets):
        raise DataError(
            f"{directory}: split {split!r}: {paths[0].name} has {len(sources)} lines but {paths[1].name} has "
            f"{len(targets)}; parallel files must be line-aligned"
        )
    if limit is not None:
        sources, targets = sources[:limit], targets[:limit]
    return ParallelText(sources, targets, directory, split, src_lang, tgt_lang)


def cache_root() -> Path:
    """``$ATTNBENCH_CACHE`` or ``~/.cache/attnbench``."""
    return Path(os.environ.get("ATTNBENCH_CACHE") or Path.home() / ".cache" / "attnbench")


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class SubwordVocab:
    """A joint sentencepiece model: ``encode(text) -> ids`` (no BOS/EOS), ``decode(ids) -> text``.
    Ids 0..3 are PAD, UNK, BOS, EOS."""

    def __init__(self, model_file: Path):
        import sentencepiece

        self.model_file = Path(model_file)
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))

    def __len__(self) -> int:
        return self.processor.get_piece_size()

    def encode(self, texts: str | list[str]):
        """Ids of one text, or a list of id lists for a list of texts."""
        return self.processor.encode(texts)

    def decode(self, ids):
        """Text of one id list (PAD, BOS, EOS dropped), or a list of texts for a list of id lists."""
        return self.processor.decode(ids)


def train_vocabulary(
    directory,
    *,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    split: str = "train",
    langs: tuple[str, str] = ("en", "de"),
    cache_dir=None,
) -> SubwordVocab:
    """The joint subword vocabulary of ``split`` (both languages) of the data set at ``directory``,
    trained on first use and then loaded from ``cache_dir`` (default ``cache_root() / 'spm'``)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an int >= 300 (256 byte pieces, 4 specials and some subwords), got {vocab_size!r}")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
    directory = dataset_dir(directory)
    files = [split_path(directory, split, lang) for lang in langs]
    settings = {"files": [_file_digest(p) for p in files], "vocab_size": vocab_size, "model_type": model_type, "format": _VOCAB_FORMAT}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    target = Path(cache_dir or cache_root() / "spm") / f"{directory.name}-{split}-{model_type}{vocab_size}-{key}"
    model_file = target / "spm.model"
    if not model_file.is_file():
        _train_sentencepiece(files, target, vocab_size, model_type, settings)
    return SubwordVocab(model_file)


def _train_sentencepiece(files: list[Path], target: Path, vocab_size: int, model_type: str, settings: dict) -> None:
    """Train into a temporary directory beside ``target``, then rename it into place, so that
    concurrent processes (torchrun ranks) never read a half-written model."""
    import sentencepiece

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".training-"))
    try:
        sentences = (line for path in files for line in read_lines(path) if line)
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_prefix=str(staging / "spm"),
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=1.0,
            byte_fallback=True,
            hard_vocab_limit=False,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            input_sentence_size=MAX_TRAINING_SENTENCES,
            shuffle_input_sentence=True,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            num_threads=1,
            minloglevel=2,
        )
        (staging / "settings.json").write_text(json.dumps(settings, indent=1))
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "spm.model").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
