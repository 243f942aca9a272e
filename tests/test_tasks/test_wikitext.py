"""WikiText loading (counts on the shared WikiText-2), data-set locations, the download helper offline."""

from __future__ import annotations

import gzip
import hashlib
import io
import urllib.error
import urllib.request

import pytest
import torch

from harness.tasks import download
from harness.tasks.download import DataError, dataset_dir
from harness.tasks.wikitext import EOS, UNK, build_vocab, load_wikitext, read_words

SHARED = download.SHARED_DATA / "wikitext-2"
needs_shared = pytest.mark.skipif(not (SHARED / "wiki.train.tokens").is_file(), reason=f"the shared WikiText-2 is not at {SHARED}")


@pytest.fixture(autouse=True)
def private_cache(request, tmp_path_factory, monkeypatch):
    """The small layouts of these tests are cached in the session's temporary directory (the
    shared WikiText-2 in the user's cache, where later sessions find it)."""
    if "shared" in request.node.name:
        return
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def write_layout(directory, train: str, valid: str = " a b \n", test: str = " b \n"):
    directory.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (directory / f"wiki.{split}.tokens").write_text(text)
    return directory


@needs_shared
def test_shared_wikitext2_counts():
    corpus = load_wikitext()
    assert corpus.directory == SHARED.resolve()
    assert corpus.vocab_size == 33_278
    assert {split: len(tokens) for split, tokens in corpus.splits.items()} == {
        "train": 2_088_628,
        "valid": 217_646,
        "test": 245_569,
    }
    assert UNK in corpus.vocab and EOS in corpus.vocab
    eos = corpus.vocab.index(EOS)
    assert int((corpus["train"] == eos).sum()) == 36_718, "one <eos> per line, empty lines included"
    assert corpus["train"].dtype == torch.long and int(corpus["train"].max()) == corpus.vocab_size - 1
    again = load_wikitext(SHARED)  # from the cache now
    assert again.vocab == corpus.vocab and torch.equal(again["test"], corpus["test"])


@needs_shared
def test_shared_files_match_the_published_checksums():
    for file, (_, algorithm, expected) in download.SOURCES["wikitext-2"].files.items():
        assert hashlib.new(algorithm, (SHARED / file).read_bytes()).hexdigest() == expected, file


def test_words_and_vocabulary_of_a_small_layout(tmp_path):
    directory = write_layout(tmp_path / "wt", " = Title = \n \n b a b <unk> \n", valid=" a zebra \n")
    assert read_words(directory / "wiki.train.tokens") == ["=", "Title", "=", EOS, EOS, "b", "a", "b", UNK, EOS]
    corpus = load_wikitext(directory)
    # by count (= 2, <eos> 3, b 2), ties in order of first appearance
    assert corpus.vocab == [EOS, "=", "b", "Title", "a", UNK]
    assert corpus["valid"].tolist() == [4, 5, 0], "a word outside the training vocabulary reads as <unk>"
    assert build_vocab(["x", "y", "y"]) == ["y", "x"]


def test_unigram_entropy(tmp_path):
    corpus = load_wikitext(write_layout(tmp_path / "wt", " a a b \n"))  # a: 2, b: 1, <eos>: 1
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert corpus.unigram_entropy() == pytest.approx(float(-(p * p.log()).sum()))


def test_cache_follows_changed_files(tmp_path):
    directory = write_layout(tmp_path / "wt", " a b \n")
    assert load_wikitext(directory).vocab == ["a", "b", EOS]
    write_layout(directory, " b b a \n")
    assert load_wikitext(directory).vocab == ["b", "a", EOS]
    write_layout(directory, " b \n")
    with pytest.raises(ValueError, match=r"wiki\.valid\.tokens: 1 words outside the training vocabulary \(e\.g\. 'a'\)"):
        load_wikitext(directory)


def test_missing_file_names_the_directory_and_file(tmp_path):
    directory = write_layout(tmp_path / "wt", " a \n")
    (directory / "wiki.valid.tokens").unlink()
    with pytest.raises(DataError, match=rf"{directory}.*lacks wiki\.valid\.tokens.*ATTNBENCH_DATA"):
        load_wikitext(directory)


def test_data_env_overrides_the_shared_data(tmp_path, monkeypatch):
    write_layout(tmp_path / "wikitext-2", " q a b \n")
    monkeypatch.setenv("ATTNBENCH_DATA", str(tmp_path))
    assert dataset_dir("wikitext-2") == tmp_path / "wikitext-2"
    assert "q" in load_wikitext().vocab
    with pytest.raises(DataError, match="multi30k"):
        dataset_dir("multi30k")


def test_download_offline_says_where_to_put_the_files(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match=r"cannot download https://.*wikitext-2-v1\.zip.*wiki\.train\.tokens.*wikitext-2/"):
        download.download("wikitext-2", tmp_path)
    with pytest.raises(DataError, match="sacrebleu -t wmt14 -l en-de --echo src"):
        download.download("wmt14-newstest2014", tmp_path)
    with pytest.raises(ValueError, match="unknown data set 'ptb'"):
        download.download("ptb", tmp_path)


def test_download_extracts_and_verifies(tmp_path, monkeypatch):
    """A served .gz is gunzipped and checked; a wrong checksum is refused and leaves no file."""
    payload = b"two words\n"
    served = {"https://x/good.gz": gzip.compress(payload), "https://x/bad.gz": gzip.compress(b"other\n")}

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(served[url]))
    digest = hashlib.sha256(payload).hexdigest()
    monkeypatch.setitem(download.SOURCES, "toy", download.Source({"f.txt": ("https://x/good.gz", "sha256", digest)}))
    monkeypatch.setitem(download.LAYOUTS, "toy", ("f.txt",))
    assert (download.download("toy", tmp_path) / "f.txt").read_bytes() == payload
    monkeypatch.setitem(download.SOURCES, "toy", download.Source({"g.txt": ("https://x/bad.gz", "sha256", digest)}))
    with pytest.raises(DataError, match="expected"):
        download.download("toy", tmp_path)
    assert sorted(path.name for path in (tmp_path / "toy").iterdir()) == ["f.txt"]


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "wiki.train.tokens"
    path.write_bytes(b"one two\nthree \xff four\n")
    with pytest.raises(DataError, match=r"wiki\.train\.tokens is not UTF-8 text \(invalid start byte\)"):
        read_words(path)
