"""Where the quality tasks' data sets live, and how to fetch them on a machine with internet.

A data set is a directory in its standard layout (``wikitext-2/wiki.train.tokens``,
``multi30k/train.en``, ...). ``dataset_dir(name)`` finds it: an explicit path first, then
``$ATTNBENCH_DATA/<name>``, then the shared data next to the repository
(``<repo>/../shared/data/<name>``). ``download(name, to)`` fetches a known data set and checks
every extracted file against its published checksum; offline it fails with a message that
says where to put the files instead.

A download is hostile until checked: it is streamed to disk under a size and time cap, its
archive's checksum (where one is published) verified before anything is extracted, and each
member extracted on its own under caps on its size and its ratio to the compressed size (a zip
or gzip bomb stops at the cap), all in a temporary directory inside the data set's, whose files
are renamed into place only once every one has its checksum. A truncated archive, a file that is
not an archive, a bomb or a wrong checksum is a DataError of one line naming the URL and file,
and leaves nothing behind.

Checksums: the SHA-1s of the WikiText archives and files are those apache/mxnet gives for
``wikitext-{2,103}-v1.zip`` (``python/mxnet/gluon/contrib/data/text.py``); the WikiText-2 ones
were verified against the shared copy. The Multi30k SHA-256s are those of the shared copy
(``/work/shared/data/README.md``), made from the same URLs (no checksum of the ``.gz`` files is
published: each is checked after its capped decompression, before it is renamed into place).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import tempfile
import time
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

#: Environment variable naming a directory that holds ``wikitext-2/``, ``multi30k/``, ...
DATA_ENV = "ATTNBENCH_DATA"
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TIMEOUT_S = 60
#: Caps on what a download may take: bytes fetched per archive, seconds per archive, bytes of one
#: extracted file, and the ratio of a file's bytes to its compressed bytes (text deflates about 3-4x;
#: a decompression bomb, thousands of times). WikiText-103: a 190 MB archive, a 540 MB training file.
MAX_ARCHIVE_BYTES = 2**30
MAX_DOWNLOAD_S = 3600
MAX_FILE_BYTES = 2**31
MAX_RATIO = 100
CHUNK = 1 << 20


class DataError(FileNotFoundError):
    """A data set that is missing or incomplete; the message names the directory and the files."""


@dataclass(frozen=True)
class Source:
    """A downloadable data set: ``files`` maps each file of the layout to ``(url, algorithm,
    checksum)``; a ``.zip`` url is shared by several files and extracted, a ``.gz`` one gunzipped.
    ``archives``: the published ``(algorithm, checksum)`` of a url's archive, checked before extraction."""

    files: dict[str, tuple[str, str, str]]
    archives: dict[str, tuple[str, str]] = field(default_factory=dict)
    note: str = ""


_SALESFORCE = "https://s3.amazonaws.com/research.metamind.io/wikitext"
_MULTI30K = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"

SOURCES: dict[str, Source] = {
    "wikitext-2": Source(
        {
            "wiki.train.tokens": (f"{_SALESFORCE}/wikitext-2-v1.zip", "sha1", "863f29c46ef9d167fff4940ec821195882fe29d1"),
            "wiki.valid.tokens": (f"{_SALESFORCE}/wikitext-2-v1.zip", "sha1", "0418625c8b4da6e4b5c7a0b9e78d4ae8f7ee5422"),
            "wiki.test.tokens": (f"{_SALESFORCE}/wikitext-2-v1.zip", "sha1", "c7b8ce0aa086fb34dab808c5c49224211eb2b172"),
        },
        {f"{_SALESFORCE}/wikitext-2-v1.zip": ("sha1", "3c914d17d80b1459be871a5039ac23e752a53cbe")},
    ),
    "wikitext-103": Source(
        {
            "wiki.train.tokens": (f"{_SALESFORCE}/wikitext-103-v1.zip", "sha1", "b7497e2dfe77e72cfef5e3dbc61b7b53712ac211"),
            "wiki.valid.tokens": (f"{_SALESFORCE}/wikitext-103-v1.zip", "sha1", "c326ac59dc587676d58c422eb8a03e119582f92b"),
            "wiki.test.tokens": (f"{_SALESFORCE}/wikitext-103-v1.zip", "sha1", "8a5befc548865cec54ed4273cf87dbbad60d1e47"),
        },
        {f"{_SALESFORCE}/wikitext-103-v1.zip": ("sha1", "0aec09a7537b58d4bb65362fee27650eeaba625a")},
    ),
    "multi30k": Source(
        {
            "train.en": (f"{_MULTI30K}/train.en.gz", "sha256", "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6"),
            "train.de": (f"{_MULTI30K}/train.de.gz", "sha256", "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72"),
            "val.en": (f"{_MULTI30K}/val.en.gz", "sha256", "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227"),
            "val.de": (f"{_MULTI30K}/val.de.gz", "sha256", "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660"),
            "test_2016_flickr.en": (f"{_MULTI30K}/test_2016_flickr.en.gz", "sha256", "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182"),
            "test_2016_flickr.de": (f"{_MULTI30K}/test_2016_flickr.de.gz", "sha256", "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16"),
        }
    ),
}

#: Data sets fetched with another tool: what to run instead.
ELSEWHERE = {
    "wmt14-newstest2014": ("sacrebleu -t wmt14 -l en-de --echo src > newstest2014.en && sacrebleu -t wmt14 -l en-de --echo ref > newstest2014.de"),
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
        raise DataError(f"{name}: {directory} lacks {', '.join(missing)}. {where_to_put(name)}")


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


def download(name: str, to) -> Path:
    """Fetch data set ``name`` into ``to/<name>/`` and verify every file's checksum (files already
    there with the right checksum are kept). Offline, raises DataError saying where to put them;
    a hostile or broken download (module docstring) is a DataError naming it, with nothing left behind."""
    if name in ELSEWHERE:
        raise DataError(f"{name} is fetched with sacrebleu: {ELSEWHERE[name]} (in the directory {Path(to) / name})")
    if name not in SOURCES:
        raise ValueError(f"unknown data set {name!r}; known: {', '.join(list(SOURCES) + list(ELSEWHERE))}")
    source, directory = SOURCES[name], Path(to).expanduser() / name
    directory.mkdir(parents=True, exist_ok=True)
    needed = {file: entry for file, entry in source.files.items() if not ((directory / file).is_file() and _checksum(directory / file, entry[1]) == entry[2])}
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=".download-"))
    try:
        for url in dict.fromkeys(url for url, _, _ in needed.values()):
            archive = staging / ".archive"
            _fetch(name, url, archive)
            if url in source.archives and (actual := _checksum(archive, source.archives[url][0])) != source.archives[url][1]:
                raise DataError(f"{name}: {url} has {source.archives[url][0]} {actual}, expected {source.archives[url][1]}; nothing extracted")
            for file in (file for file, entry in needed.items() if entry[0] == url):
                _extract(archive, url, file, staging / file)
                algorithm, expected = needed[file][1:]
                if (actual := _checksum(staging / file, algorithm)) != expected:
                    raise DataError(f"{name}: {file} from {url} has {algorithm} {actual}, expected {expected}")
            archive.unlink()
        for file in needed:
            os.replace(staging / file, directory / file)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _fetch(name: str, url: str, target: Path) -> None:
    """Stream ``url`` into ``target``: at most ``MAX_ARCHIVE_BYTES`` in at most ``MAX_DOWNLOAD_S``,
    and all the bytes its Content-Length announces (else it was cut short)."""
    deadline = time.monotonic() + MAX_DOWNLOAD_S
    received = 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(target, "wb") as out:
            announced = (getattr(response, "headers", None) or {}).get("Content-Length")
            while block := response.read(CHUNK):
                received += len(block)
                if received > MAX_ARCHIVE_BYTES:
                    raise DataError(f"{name}: {url} is larger than {MAX_ARCHIVE_BYTES} bytes (MAX_ARCHIVE_BYTES); refused")
                if time.monotonic() > deadline:
                    raise DataError(f"{name}: {url} took longer than {MAX_DOWNLOAD_S} s (MAX_DOWNLOAD_S); refused")
                out.write(block)
    except DataError:
        raise
    except OSError as exc:  # URLError, timeouts and refused connections are OSErrors
        raise DataError(f"{name}: cannot download {url} ({exc}). {where_to_put(name)}") from None
    if announced is not None and announced.isdigit() and received != int(announced):
        raise DataError(f"{name}: {url} is truncated: {received} of the {announced} bytes announced arrived")


def _extract(archive: Path, url: str, file: str, target: Path) -> None:
    """Write ``file`` of ``archive`` (fetched from ``url``) to ``target``: the member of that name in a
    zip, the gunzipped ``.gz``, else the download itself; stopped past ``MAX_FILE_BYTES`` or
    ``MAX_RATIO`` times its compressed size."""
    compressed = archive.stat().st_size
    try:
        with contextlib.ExitStack() as stack:
            if url.endswith(".zip"):
                members = stack.enter_context(zipfile.ZipFile(archive))
                member = next((m for m in members.infolist() if Path(m.filename).name == file and not m.is_dir()), None)
                if member is None:
                    raise DataError(f"{url} holds no {file}")
                compressed = member.compress_size
                source = stack.enter_context(members.open(member))
            elif url.endswith(".gz"):
                source = stack.enter_context(gzip.open(archive))
            else:
                source = stack.enter_context(open(archive, "rb"))
            _copy_capped(source, target, min(MAX_FILE_BYTES, max(CHUNK, MAX_RATIO * compressed)), f"{file} in {url}")
    except (zipfile.BadZipFile, gzip.BadGzipFile, EOFError, zlib.error, NotImplementedError, RuntimeError) as exc:  # RuntimeError: encrypted
        kind = "zip" if url.endswith(".zip") else "gzip"
        raise DataError(f"{url}: not a whole {kind} archive, or corrupt ({exc}); {file} not extracted") from None


def _copy_capped(source, target: Path, limit: int, what: str) -> None:
    """Copy ``source`` to ``target`` block by block, a DataError once more than ``limit`` bytes come out."""
    written = 0
    with open(target, "wb") as out:
        while block := source.read(CHUNK):
            written += len(block)
            if written > limit:
                raise DataError(
                    f"{what} decompresses to more than {limit} bytes (MAX_FILE_BYTES, or MAX_RATIO {MAX_RATIO}x its "
                    "compressed size): refused as a decompression bomb"
                )
            out.write(block)
