"""Hostile downloads (issue 46, item 2): a truncated archive, a file that is not an archive, a
decompression bomb and a wrong checksum each end in one line naming the URL and file, in bounded
memory and time, with nothing half-written left in the data directory. No network: ``urlopen`` is
monkeypatched to serve local files."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import urllib.request
import zipfile

import pytest

from harness import cli
from harness.tasks import download
from harness.tasks.download import DataError, Source

ZIP, GZ = "https://data.example/toy.zip", "https://data.example/toy.txt.gz"
FILES = {"a.txt": b"the cat sat\n" * 50, "b.txt": b"the dog ran\n" * 50}


class _Response(io.BufferedReader):
    """A local file served as ``urlopen``'s answer, with the headers a server would send."""

    def __init__(self, path, headers=None):
        super().__init__(open(path, "rb"))  # noqa: SIM115 - closed with the response
        self.headers = headers or {}


def _serve(monkeypatch, served: dict, headers=None):
    """``urlopen(url)`` answers with the local file ``served[url]``."""
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: _Response(served[url], headers))


def _toy(monkeypatch, url: str, files=FILES, archives=None) -> None:
    """Data set ``toy``: ``files`` from ``url``, with their SHA-256s (and ``archives``' checksums)."""
    entries = {file: (url, "sha256", hashlib.sha256(content).hexdigest()) for file, content in files.items()}
    monkeypatch.setitem(download.SOURCES, "toy", Source(entries, archives or {}))
    monkeypatch.setitem(download.LAYOUTS, "toy", tuple(files))


def _zip(path, files=FILES):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files.items():
            archive.writestr(f"toy/{name}", content)
    return path


def _left(tmp_path) -> list[str]:
    """What the data set's directory holds, hidden files included."""
    return sorted(path.name for path in (tmp_path / "data" / "toy").iterdir())


def _refused(tmp_path, *expected: str) -> str:
    with pytest.raises(DataError) as caught:
        download.download("toy", tmp_path / "data")
    message = str(caught.value)
    assert "\n" not in message and all(part in message for part in expected), message
    assert _left(tmp_path) == []
    return message


def test_a_served_zip_is_extracted_and_verified(tmp_path, monkeypatch):
    _serve(monkeypatch, {ZIP: _zip(tmp_path / "toy.zip")})
    archive_sha1 = hashlib.sha1((tmp_path / "toy.zip").read_bytes()).hexdigest()
    _toy(monkeypatch, ZIP, archives={ZIP: ("sha1", archive_sha1)})
    directory = download.download("toy", tmp_path / "data")
    assert {file: (directory / file).read_bytes() for file in FILES} == FILES and _left(tmp_path) == sorted(FILES)


@pytest.mark.parametrize("kind", ["zip", "gz"])
def test_a_truncated_archive_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, kind):
    whole = _zip(tmp_path / "toy.zip").read_bytes() if kind == "zip" else gzip.compress(FILES["a.txt"])
    (tmp_path / "cut").write_bytes(whole[: len(whole) // 2])
    url = ZIP if kind == "zip" else GZ
    _serve(monkeypatch, {url: tmp_path / "cut"})
    _toy(monkeypatch, url, FILES if kind == "zip" else {"a.txt": FILES["a.txt"]})
    _refused(tmp_path, url, f"not a whole {'zip' if kind == 'zip' else 'gzip'} archive")


def test_a_download_shorter_than_its_content_length_is_truncated(tmp_path, monkeypatch):
    archive = _zip(tmp_path / "toy.zip")
    _serve(monkeypatch, {ZIP: archive}, {"Content-Length": str(archive.stat().st_size + 1000)})
    _toy(monkeypatch, ZIP)
    _refused(tmp_path, ZIP, "truncated", f"{archive.stat().st_size} of the {archive.stat().st_size + 1000} bytes")


@pytest.mark.parametrize("url", [ZIP, GZ])
def test_a_file_that_is_not_an_archive_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, url):
    (tmp_path / "page.html").write_text("<html><body>Access denied</body></html>\n")
    _serve(monkeypatch, {url: tmp_path / "page.html"})
    _toy(monkeypatch, url, {"a.txt": FILES["a.txt"]})
    _refused(tmp_path, url, "not a whole")


def test_a_wrong_archive_checksum_stops_before_anything_is_extracted(tmp_path, monkeypatch):
    _serve(monkeypatch, {ZIP: _zip(tmp_path / "toy.zip")})
    _toy(monkeypatch, ZIP, archives={ZIP: ("sha1", "0" * 40)})
    monkeypatch.setattr(download, "_extract", lambda *args: pytest.fail("extracted before the archive's checksum was checked"))
    _refused(tmp_path, ZIP, "sha1", "expected 0000", "nothing extracted")


def test_a_file_with_a_wrong_checksum_leaves_the_others_unwritten(tmp_path, monkeypatch):
    """Every file is checked before any is renamed into place: a half-good archive writes nothing."""
    _serve(monkeypatch, {ZIP: _zip(tmp_path / "toy.zip", {"a.txt": FILES["a.txt"], "b.txt": b"other content\n"})})
    _toy(monkeypatch, ZIP)
    _refused(tmp_path, ZIP, "b.txt", "expected")


def test_a_download_over_its_size_cap_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "MAX_ARCHIVE_BYTES", 100)
    _serve(monkeypatch, {ZIP: _zip(tmp_path / "toy.zip")})
    _toy(monkeypatch, ZIP)
    _refused(tmp_path, ZIP, "larger than 100 bytes")


def test_data_download_says_one_line_naming_the_file_and_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "page.html").write_text("<html></html>\n")
    _serve(monkeypatch, {ZIP: tmp_path / "page.html"})
    _toy(monkeypatch, ZIP)
    assert cli.main(["data", "download", "toy", "--to", str(tmp_path / "data")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and ZIP in error[0] and "not a whole zip archive" in error[0], error
    assert _left(tmp_path) == []


#: A process that serves a bomb of ``argv[3]`` GiB of zeros as data set ``toy`` and reports the outcome,
#: its peak resident memory and the seconds the download took.
BOMB = """
import json, sys, time, urllib.request, zipfile, zlib
from pathlib import Path
from harness.tasks import download

def peak_rss_bytes():  # VmHWM: this process's own peak (getrusage's ru_maxrss keeps the parent's across exec)
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
kind, folder, gib = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
url = f"https://data.example/bomb.{kind}"
archive = folder / f"bomb.{kind}"
block = bytes(1 << 20)
if kind == "zip":
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as out, out.open("a.txt", "w", force_zip64=True) as member:
        for _ in range(gib << 10):
            member.write(block)
else:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(archive, "wb") as out:
        for _ in range(gib << 10):
            out.write(packer.compress(block))
        out.write(packer.flush())
urllib.request.urlopen = lambda url, timeout: open(archive, "rb")
download.SOURCES["toy"] = download.Source({"a.txt": (url, "sha256", "0" * 64)})
download.LAYOUTS["toy"] = ("a.txt",)
started = time.monotonic()
try:
    download.download("toy", folder / "data")
    outcome = "extracted"
except download.DataError as exc:
    outcome = str(exc)
print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - started, "compressed": archive.stat().st_size,
                  "peak_rss_bytes": peak_rss_bytes(),
                  "left": sorted(p.name for p in (folder / "data" / "toy").iterdir())}))
"""


@pytest.mark.parametrize("kind", ["zip", "gz"])
@pytest.mark.slow  # 10-30 s each: the bomb (1 GiB of zeros) is compressed first
def test_a_decompression_bomb_stops_at_its_cap_in_bounded_memory_and_time(tmp_path, kind):
    done = subprocess.run([sys.executable, "-c", BOMB, kind, str(tmp_path), "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["compressed"] < 2**30 / 200  # a bomb: over 200 times smaller than what it holds
    assert "decompresses to more than" in report["outcome"] and "bomb" in report["outcome"] and f"bomb.{kind}" in report["outcome"], report
    assert "\n" not in report["outcome"] and report["left"] == []
    assert report["peak_rss_bytes"] < 400 * 2**20 and report["seconds"] < 60, report
