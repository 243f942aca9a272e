"""Parallel text loader and the sentencepiece vocabulary, on the shared data and on made-up directories."""

from __future__ import annotations

import pytest

from harness.tasks.parallel_text import DataError, data_root, dataset_dir, read_lines, read_parallel, train_vocabulary


def shared(name: str):
    """The shared data set ``name``, or a skip that says where it was looked for."""
    path = data_root() / name
    if not path.is_dir():
        pytest.skip(f"{name} is not at {path} (set ATTNBENCH_DATA to the directory holding {name}/)")
    return path


@pytest.fixture(scope="module")
def multi30k_vocab(tmp_path_factory):
    """A small joint vocabulary of the Multi30k training split, trained into a fresh cache."""
    shared("multi30k")
    return train_vocabulary("multi30k", vocab_size=1000, cache_dir=tmp_path_factory.mktemp("spm"))


@pytest.mark.parametrize("split, pairs", [("train", 29_000), ("val", 1_014), ("test_2016_flickr", 1_000)])
def test_multi30k_counts(split, pairs):
    text = read_parallel(shared("multi30k"), split)
    assert len(text) == len(text.sources) == len(text.targets) == pairs
    assert text.sources[0] and text.targets[0]
    if split == "train":
        assert text.sources[0] == "Two young, White males are outside near many bushes."
        assert text.targets[0] == "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."


def test_newstest2014_counts():
    text = read_parallel(shared("wmt14-newstest2014"), "newstest2014")
    assert len(text) == 3_003
    assert sum(len(line.split()) for line in text.sources) == 59_325, "the data README's word count"


def test_name_resolves_under_data_root_and_env(tmp_path, monkeypatch):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "train.en").write_text("a b\nc\n", encoding="utf-8")
    (tmp_path / "toy" / "train.de").write_text("x y\nz\n", encoding="utf-8")
    monkeypatch.setenv("ATTNBENCH_DATA", str(tmp_path))
    assert data_root() == tmp_path and dataset_dir("toy") == tmp_path / "toy"
    text = read_parallel("toy", "train")
    assert (text.sources, text.targets) == (["a b", "c"], ["x y", "z"])
    assert read_parallel(tmp_path / "toy", "train", limit=1).sources == ["a b"]


def test_lines_split_on_newline_only(tmp_path):
    path = tmp_path / "f.en"
    path.write_bytes(b"one\rstill one\x0cand\n two \n\nfour")
    assert read_lines(path) == ["one\rstill one\x0cand", " two ", "", "four"]


def test_missing_directory_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_DATA", str(tmp_path))
    with pytest.raises(DataError, match="no parallel text directory 'wmt14'.*ATTNBENCH_DATA"):
        read_parallel("wmt14", "train")


def test_missing_file_names_directory_split_language_and_file(tmp_path):
    (tmp_path / "train.en").write_text("a\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        read_parallel(tmp_path, "train", "en", "de")
    message = str(error.value)
    for part in (str(tmp_path), "split 'train'", "language 'de'", "missing file train.de", "holds: train.en"):
        assert part in message, message


def test_mismatched_line_counts(tmp_path):
    (tmp_path / "train.en").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "train.de").write_text("x\ny\n", encoding="utf-8")
    with pytest.raises(DataError, match="train.en has 3 lines but train.de has 2"):
        read_parallel(tmp_path, "train")


def test_vocabulary_round_trip_on_real_sentences(multi30k_vocab):
    """decode(encode(s)) == s exactly: identity normalisation, whitespace kept, byte fall-back
    for characters the training split never saw (newstest2014 has plenty)."""
    vocab = multi30k_vocab
    assert len(vocab) == 1000
    texts = []
    for name, split in (("multi30k", "val"), ("multi30k", "test_2016_flickr"), ("multi30k", "train")):
        text = read_parallel(shared(name), split, limit=1000)
        texts += text.sources + text.targets
    news = data_root() / "wmt14-newstest2014"
    if news.is_dir():
        text = read_parallel(news, "newstest2014", limit=500)
        texts += text.sources + text.targets
    ids = vocab.encode(texts)
    assert all(min(row) >= 4 for row in ids if row), "no PAD/UNK/BOS/EOS inside encoded text"
    assert vocab.decode(ids) == texts
    assert vocab.decode(ids[0] + [3, 0, 0]) == texts[0], "EOS and PAD decode to nothing"


def test_vocabulary_is_cached_by_data_and_settings(multi30k_vocab):
    cache = multi30k_vocab.model_file.parent.parent
    again = train_vocabulary("multi30k", vocab_size=1000, cache_dir=cache)
    assert again.model_file == multi30k_vocab.model_file
    assert sorted(p.name for p in cache.iterdir()) == [multi30k_vocab.model_file.parent.name], "one cached model, no leftovers"


def test_vocabulary_key_follows_the_files(tmp_path):
    for lang, words in (("en", "the cat sat on a mat"), ("de", "die Katze sass auf einer Matte")):
        (tmp_path / f"train.{lang}").write_text("".join(f"{words} {i}\n" for i in range(200)), encoding="utf-8")
    first = train_vocabulary(tmp_path, vocab_size=300, cache_dir=tmp_path / "cache")
    (tmp_path / "train.de").write_text("andere Worte\n" * 200, encoding="utf-8")
    second = train_vocabulary(tmp_path, vocab_size=300, cache_dir=tmp_path / "cache")
    assert first.model_file != second.model_file
    assert second.decode(second.encode("andere Worte")) == "andere Worte"


@pytest.mark.parametrize("kwargs, field", [(dict(vocab_size=10), "vocab_size"), (dict(model_type="word"), "model_type")])
def test_vocabulary_bad_settings(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        train_vocabulary(tmp_path, cache_dir=tmp_path / "cache", **kwargs)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "train.de"
    path.write_bytes(b"eins\nzwei \xc3\x28\n")
    with pytest.raises(DataError, match=r"train\.de is not UTF-8 text \(byte 10: invalid continuation byte\)"):
        read_lines(path)
