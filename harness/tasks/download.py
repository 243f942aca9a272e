"""Where the quality tasks' data sets live, and how to fetch them on a machine with internet.

A data set is a directory in its standard layout (``wikitext-2/wiki.train.tokens``,
``multi30k/train.en``, ...). ``dataset_dir(name)`` finds it: an explicit path first, then
``$ATTNBENCH_DATA/<name>``, then the shared data next to the repository
(``<repo>/../shared/data/<name>``). ``download(name, to)`` fetches a known data set and checks
every extracted file against its published checksum; offline it fails with a message that
says where to put the files instead.

Checksums: the SHA-1s of the WikiText files are those apache/mxnet gives for
``wikitext-{2,103}-v1.zip`` (``python/mxnet/gluon/contrib/data/text.py``); the WikiText-2 ones
were verified against the shared copy. The Multi30k SHA-256s are those of the shared copy
(``/work/shared/data/README.md``), made from the same URLs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

#: Environment variable naming a directory that holds ``wikitext-2/``, ``multi30k/``, ...
DATA_ENV = "ATTNBENCH_DATA"
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TIMEOUT_S = 60


class DataError(FileNotFoundError):
    """A data set that is missing or incomplete; the message names the directory and the files."""


@dataclass(frozen=True)
class Source:
    """A downloadable data set: ``files`` maps each file of the layout to ``(url, algorithm,
    checksum)``; a ``.zip`` url is shared by several files and extracted, a ``.gz`` one gunzipped."""

    files: dict[str, tuple[str, str, str]]
    note: str = ""


_SALESFORCE = "https://s3.amazonaws.com/research.metamind.io/wikitext"
_MULTI30K = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"

SOURCES: dict[str, Source] = {
    "wikitext-2": Source({
        "wiki.train.tokens": (f"{_SALESFORCE}/wikitext-2-v1.zip", "sha1", "863f29c46ef9d167fff4940ec821195882fe29d1"),
        "wiki.valid.tokens": (f"{_SALESFORCE}/wikitext-2-v1.zip", "sha1", "0418625c8b4da6e4b5c7a0b9e78d4ae8f7ee5422"),
        "wiki.test.tokens": (f"{_SALESFORCE}/wikitext-2-v1.zip", "sha1", "c7b8ce0aa086fb34dab808c5c49224211eb2b172"),
    }),
    "wikitext-103": Source({
        "wiki.train.tokens": (f"{_SALESFORCE}/wikitext-103-v1.zip", "sha1", "b7497e2dfe77e72cfef5e3dbc61b7b53712ac211"),
        "wiki.valid.tokens": (f"{_SALESFORCE}/wikitext-103-v1.zip", "sha1", "c326ac59dc587676d58c422eb8a03e119582f92b"),
        "wiki.test.tokens": (f"{_SALESFORCE}/wikitext-103-v1.zip", "sha1", "8a5befc548865cec54ed4273cf87dbbad60d1e47"),
    }),
    "multi30k": Source({
        "train.en": (f"{_MULTI30K}/train.en.gz", "sha256", "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6"),
        "train.de": (f"{_MULTI30K}/train.de.gz", "sha256", "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72"),
        "val.en": (f"{_MULTI30K}/val.en.gz", "sha256", "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227"),
        "val.de": (f"{_MULTI30K}/val.de.gz", "sha256", "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660"),
        "test_2016_flickr.en": (
            f"{_MULTI30K}/test_2016_flickr.en.gz", "sha256", "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182"),
        "test_2016_flickr.de": (
            f"{_MULTI30K}/test_2016_flickr.de.gz", "sha256", "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16"),
    }),
}

#: Data sets fetched with another tool: what to run instead.
ELSEWHERE = {
    "wmt14-newstest2014": (
        "sacrebleu -t wmt14 -l en-de --echo src > newstest2014.en && "
        "sacrebleu -t wmt14 -l en-de --echo ref > newstest2014.de"
    ),
}

#: The files each layout needs (a directory in this layout works wherever it came from).
LAYOUTS = {name: tuple(source.files) for name, source in SOURCES.items()} | {
    "wmt14-newstest2014": ("newstest2014.en", "newstest2014.de"),
}


def dataset_dir(name: str, explicit=None) -> Path:
    """The directory of data set ``name``: ``explicit`` if given, else ``$ATTNBENCH_DATA/<name>``,
    else ``<repo>/../shared/data/<name>``. Raises DataError naming the directory and the
    missing files when the layout is incomplete."""
    if explicit is not None:
        directory = Path(explicit).expanduser()
    elif os.environ.get(DATA_ENV):
        directory = Path(os.environ[DATA_ENV]).expanduser() / name
    else:
        directory = SHARED_DATA / name
    check_layout(name, directory)
    return directory


def check_layout(name: str, directory: Path) -> None:
    """Raise DataError unless ``directory`` holds every file of ``name``'s layout."""
    needed = LAYOUTS.get(name)
    if needed is None:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(LAYOUTS)}")
    missing = [file for file in needed if not (directory / file).is_file()]
    if missing:
        raise DataError(
            f"{name}: {directory} lacks {', '.join(missing)}. {where_to_put(name)}"
        )


def where_to_put(name: str) -> str:
    """How to provide data set ``name`` by hand."""
    files = ", ".join(LAYOUTS[name])
    how = f"run: {ELSEWHERE[name]}" if name in ELSEWHERE else f"run `attnbench data download {name} --to DIR`"
    return (
        f"Put the files ({files}) in a directory named {name}/ under ${DATA_ENV}, or pass the directory "
        f"explicitly; to fetch them on a machine with internet, {how}."
    )


def _checksum(path: Path, algorithm: str) -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return response.read()


def download(name: str, to) -> Path:
    """Fetch data set ``name`` into ``to/<name>/`` and verify every file's checksum (files already
    there with the right checksum are kept). Offline, raises DataError saying where to put them."""
    if name in ELSEWHERE:
        raise DataError(f"{name} is fetched with sacrebleu: {ELSEWHERE[name]} (in the directory {Path(to) / name})")
    if name not in SOURCES:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(list(SOURCES) + list(ELSEWHERE))}")
    directory = Path(to).expanduser() / name
    directory.mkdir(parents=True, exist_ok=True)
    archives: dict[str, bytes] = {}
    for file, (url, algorithm, expected) in SOURCES[name].files.items():
        target = directory / file
        if target.is_file() and _checksum(target, algorithm) == expected:
            continue
        if url not in archives:
            try:
                archives[url] = _fetch(url)
            except OSError as exc:  # URLError, timeouts and refused connections are OSErrors
                raise DataError(f"{name}: cannot download {url} ({exc}). {where_to_put(name)}") from None
        temporary = target.with_suffix(target.suffix + ".part")
        with open(temporary, "wb") as out:
            out.write(_extract(archives[url], url, file))
        if (actual := _checksum(temporary, algorithm)) != expected:
            temporary.unlink()
            raise DataError(f"{name}: {file} from {url} has {algorithm} {actual}, expected {expected}")
        os.replace(temporary, target)
    return directory


def _extract(payload: bytes, url: str, file: str) -> bytes:
    """The bytes of ``file``: the member of that name in a zip, or the gunzipped ``.gz``."""
    if url.endswith(".zip"):
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            member = next((m for m in archive.namelist() if Path(m).name == file), None)
            if member is None:
                raise DataError(f"{url} holds no {file}")
            with archive.open(member) as source, io.BytesIO() as out:
                shutil.copyfileobj(source, out)
                return out.getvalue()
    if url.endswith(".gz"):
        return gzip.decompress(payload)
    return payload
