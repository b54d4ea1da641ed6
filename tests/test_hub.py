"""Models by their Hugging Face name (pycalm.app.hub), downloaded by the real huggingface_hub
client from a local server that answers as the Hub does (HF_ENDPOINT points at it).

FakeHub serves the requests huggingface_hub makes for model_info and snapshot_download:

    GET  /api/models/{repo}[/revision/{rev}]      {"id", "sha", "siblings": [{"rfilename"}]}
    GET  /api/models/{repo}/tree/{rev}?recursive  [{"type": "file", "path", "size", "oid"}]
    HEAD /{repo}/resolve/{rev}/{file}             ETag, X-Repo-Commit, Content-Length
    GET  /{repo}/resolve/{rev}/{file}             the bytes (a Range too, for a resumed download)

and answers an unknown repository with 404 and X-Error-Code RepoNotFound, a gated one's files
with 401 and X-Error-Code GatedRepo, as the Hub does. Each test has its own HF_HOME (the
downloads) and pycalm cache (the conversions); the command lines run as test_cli runs them.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from test_cli import REPO, _env, assert_one_error_line
from test_serve import wait_healthy
from tiny_models import make_gguf, make_hf_llama

from pycalm.app.hub import CONNECT_TIMEOUT_S, choose_files, gguf_tag, parse_hub_name
from pycalm.errors import PycalmError

HF_REPO = "tiny-org/tiny-llama"  # a Hugging Face folder, and files pycalm does not need
GGUF_REPO = "tiny-org/tiny-llama-GGUF"  # three GGUF files
GATED_REPO = "tiny-org/gated"
GGUF_FILES = ("tiny-Q8_0.gguf", "tiny-Q4_0.gguf", "tiny-Q4_1.gguf")
UNNEEDED = ("README.md", "pytorch_model.bin", "onnx/model.safetensors")
GENERATE = ("-i", "the cat", "-n", "8", "-t", "0", "--device", "cpu")


class FakeHub:
    """A Hub at http://127.0.0.1:{port} serving `repos` ({repo id: {path: bytes}}), each at one
    commit; `requests` logs every (method, path) it was asked."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated: tuple[str, ...] = ()) -> None:
        self.repos = repos
        self.gated = gated
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of the resumed downloads
        self.cut_once: set[str] = set()  # files whose first GET drops the connection half-way
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> set[str]:
        """The files whose bytes were asked for (GET .../resolve/...)."""
        return {
            p.split("/resolve/", 1)[1].split("/", 1)[1]
            for m, p in self.requests
            if m == "GET" and "/resolve/" in p
        }

    @staticmethod
    def send(
        h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool
    ) -> None:
        h.send_response(status)
        for k, v in {"Content-Length": str(len(data)), **headers}.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def error(self, h: BaseHTTPRequestHandler, status: int, code: str, body: bool) -> None:
        data = json.dumps({"error": code}).encode()
        self.send(h, status, data, {"Content-Type": "application/json", "X-Error-Code": code}, body)

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo, rest = "/".join(parts[:2]), parts[2:]
        if repo not in self.repos:
            return self.error(h, 404, "RepoNotFound", body)
        files, commit = self.repos[repo], self.commits[repo]
        if (
            rest
            and rest[0] in ("revision", "tree", "resolve")
            and len(rest) > 1
            and rest[1] not in ("main", commit)
        ):
            return self.error(h, 404, "RevisionNotFound", body)
        if api and (not rest or rest[0] == "revision"):  # model_info / repo_info
            info = {
                "id": repo,
                "sha": commit,
                "private": False,
                "siblings": [{"rfilename": f} for f in files],
            }
            return self.send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if api and rest[0] == "tree":  # list_repo_tree, recursive, one page
            tree = [
                {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for f, d in files.items()
            ]
            return self.send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        if not api and rest[0] == "resolve":  # hf_hub_download: HEAD for the metadata, then GET
            if repo in self.gated:
                return self.error(h, 401, "GatedRepo", body)
            name = "/".join(rest[2:])
            if name not in files:
                return self.error(h, 404, "EntryNotFound", body)
            data = files[name]
            headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": commit}
            start = int(h.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
            if start:  # a resumed download
                self.ranges.append((name, h.headers["Range"]))
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                return self.send(h, 206, data[start:], headers, body)
            if body and name in self.cut_once:  # the connection drops half-way through the file
                self.cut_once.discard(name)
                self.send(h, 200, data[: len(data) // 2], {**headers, "Content-Length": str(len(data))}, body)
                h.close_connection = True
                return None
            return self.send(h, 200, data, headers, body)
        return self.error(h, 404, "NotFound", body)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny models on disk: the HF folder and the GGUF files the fake Hub serves."""
    tmp = tmp_path_factory.mktemp("hub_sources")
    hf = make_hf_llama(tmp, arch="llama", name="tiny-llama")
    out = {"hf": hf.path}
    for name in GGUF_FILES:
        out[name] = make_gguf(tmp, arch="llama", qtype=name[5:-5], name=name).path
    return out


@pytest.fixture
def hub(sources) -> FakeHub:
    hf_files = {p.name: p.read_bytes() for p in sources["hf"].iterdir()}
    hf_files.update({f: b"not for pycalm" for f in UNNEEDED})
    repos = {
        HF_REPO: hf_files,
        GGUF_REPO: {name: sources[name].read_bytes() for name in GGUF_FILES},
        GATED_REPO: dict(hf_files),
    }
    server = FakeHub(repos, gated=(GATED_REPO,))
    yield server
    server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_hub(hub: FakeHub, tmp_path: Path, *args: str, offline: bool = False, code: str | None = None):
    """Run the CLI (or `python -c code`) with HF_ENDPOINT at the fake Hub and HF_HOME under tmp_path."""
    env = _env()
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_TOKEN", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env.pop("HF_HUB_OFFLINE", None)
    argv = ["-c", code] if code else ["-m", "pycalm.generate", *args, "--cache-dir", str(tmp_path / "cache")]
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def run_local(src: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "pycalm.generate",
        str(src),
        *GENERATE,
        "--cache-dir",
        str(tmp_path / "local"),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)


# ---------------------------------------------------------------------------------------------
# end to end through the CLI


def test_safetensors_by_name_then_offline(hub, sources, tmp_path):
    """ORG/NAME downloads the files of a Hugging Face folder (only those), converts them, and
    gives the local folder's tokens; with the Hub stopped and HF_HUB_OFFLINE=1 it runs from the
    cache without a word about fetching."""
    local = run_local(sources["hf"], tmp_path)
    assert local.returncode == 0 and local.stdout, local.stderr
    online = run_hub(hub, tmp_path, HF_REPO, *GENERATE)
    assert online.returncode == 0, online.stderr
    assert online.stdout == local.stdout
    assert f"of {HF_REPO} from {hub.url}" in online.stderr and "converting tiny-llama" in online.stderr
    assert hub.fetched() == {p.name for p in sources["hf"].iterdir()}  # nothing of UNNEEDED
    # the same bytes: the conversion's content key equals the local folder's
    (entry,) = (tmp_path / "cache").glob("*.pycalm")
    (local_entry,) = (tmp_path / "local").glob("*.pycalm")
    assert entry.name == local_entry.name == f"tiny-llama-fp16-{local_entry.stem.rsplit('-', 1)[1]}.pycalm"

    hub.stop()
    offline = run_hub(hub, tmp_path, HF_REPO, *GENERATE, offline=True)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == local.stdout
    assert "fetching" not in offline.stderr and "converting" not in offline.stderr

    # the name's files are in HF's cache, but the conversion is not: converted again, offline
    offline = run_hub(hub, tmp_path, HF_REPO, *GENERATE, "--dtype", "q8", offline=True)
    assert offline.returncode == 0, offline.stderr
    assert "fetching" not in offline.stderr and "converting tiny-llama to q8" in offline.stderr


def test_gguf_by_tag_then_unreachable(hub, sources, tmp_path):
    """ORG/NAME:tag downloads the one GGUF file of that quant tag (any case); later, with the
    server gone (connection refused, no HF_HUB_OFFLINE), the cached file is used."""
    local = run_local(sources["tiny-Q8_0.gguf"], tmp_path)
    assert local.returncode == 0 and local.stdout, local.stderr
    online = run_hub(hub, tmp_path, f"{GGUF_REPO}:q8_0", *GENERATE)
    assert online.returncode == 0, online.stderr
    assert online.stdout == local.stdout
    assert hub.fetched() == {"tiny-Q8_0.gguf"}
    assert "converting tiny-Q8_0 to fp16" in online.stderr

    hub.stop()
    again = run_hub(hub, tmp_path, f"hf.co/{GGUF_REPO}:Q8_0", *GENERATE)
    assert again.returncode == 0, again.stderr
    assert again.stdout == local.stdout
    assert "fetching" not in again.stderr and "converting" not in again.stderr
    # offline, a tag that was never downloaded: one line
    missing = run_hub(hub, tmp_path, f"{GGUF_REPO}:Q4_0", *GENERATE)
    assert_one_error_line(
        missing, f"{GGUF_REPO}:Q4_0 is not downloaded yet", "cannot connect", "tiny-Q8_0.gguf"
    )


def test_tag_errors_list_the_tags(hub, tmp_path):
    """No file of the tag, or several: one line listing the repository's tags, nothing fetched."""
    line = assert_one_error_line(run_hub(hub, tmp_path, f"{GGUF_REPO}:Q5_K_M", *GENERATE), "Q5_K_M")
    assert line.endswith("its tags: Q4_0, Q4_1, Q8_0"), line
    line = assert_one_error_line(run_hub(hub, tmp_path, f"{GGUF_REPO}:q4", *GENERATE), "tiny-Q4_0.gguf")
    assert "tiny-Q4_1.gguf" in line and line.endswith("its tags: Q4_0, Q4_1, Q8_0"), line
    # no tag and several GGUF files (no Q4_K_M among them): asks for one
    line = assert_one_error_line(run_hub(hub, tmp_path, GGUF_REPO, *GENERATE), f"{GGUF_REPO}:TAG")
    assert not hub.fetched()


def test_unknown_gated_and_offline_names(hub, tmp_path):
    """An unknown repository, a gated one, and offline a name never downloaded: each one line
    and a non-zero exit; a name that is not ORG/NAME keeps the old error."""
    assert_one_error_line(
        run_hub(hub, tmp_path, "tiny-org/nothing-here", *GENERATE), "model not found: tiny-org/nothing-here"
    )
    # a gated repository lists its files; its downloads are refused: the fetch notice, then one line
    gated = run_hub(hub, tmp_path, GATED_REPO, *GENERATE)
    notice, error = gated.stderr.strip("\n").splitlines()
    assert gated.returncode != 0 and notice.startswith("pycalm: fetching"), gated.stderr
    assert error.startswith(f"error: {GATED_REPO} is a gated model"), gated.stderr
    assert_one_error_line(run_hub(hub, tmp_path, HF_REPO, *GENERATE, offline=True), HF_REPO, "HF_HUB_OFFLINE")
    assert_one_error_line(
        run_hub(hub, tmp_path, "no-such-model", *GENERATE), "model not found: no-such-model"
    )
    # a name the Hub's own check refuses ("--" in it)
    assert_one_error_line(
        run_hub(hub, tmp_path, "tiny-org/a--b", *GENERATE), "model not found: tiny-org/a--b"
    )
    assert not [r for r in hub.requests if "nothing-here" not in r[1] and GATED_REPO not in r[1]]


def test_load_by_name(hub, sources, tmp_path):
    """pycalm.load("ORG/NAME") in Python: the same greedy text as the local folder, and the
    model's name is the Hub name."""
    code = (
        "import pycalm, sys\n"
        f"hub = pycalm.load({HF_REPO!r}, device='cpu', cache_dir={str(tmp_path / 'cache')!r}, verbose=False)\n"
        f"local = pycalm.load({str(sources['hf'])!r}, device='cpu', cache_dir={str(tmp_path / 'local')!r}, verbose=False)\n"
        "a, b = (m.generate('the cat', max_tokens=8, temperature=0) for m in (hub, local))\n"
        "assert a == b and a, (a, b)\n"
        "print(hub.name)\n"
    )
    proc = run_hub(hub, tmp_path, code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == HF_REPO


def test_download_resumes(tmp_path):
    """A connection that drops half-way through a file is taken up again with a Range request
    for the rest (huggingface_hub's http_get resumes after the last whole chunk it wrote, 10 MB:
    so a model of 27 MB), and the model is whole: the local folder's tokens."""
    big = make_hf_llama(tmp_path / "src", dim=512, hidden_dim=1024, n_layers=3, n_heads=8, name="big-llama")
    weights = (big.path / "model.safetensors").read_bytes()
    hub = FakeHub({"tiny-org/big-llama": {p.name: p.read_bytes() for p in big.path.iterdir()}})
    hub.cut_once.add("model.safetensors")
    try:
        proc = run_hub(hub, tmp_path, "tiny-org/big-llama", *GENERATE)
    finally:
        hub.stop()
    assert proc.returncode == 0, proc.stderr
    ((name, range_),) = hub.ranges
    start = int(range_.removeprefix("bytes=").removesuffix("-"))
    assert name == "model.safetensors" and 0 < start <= len(weights) // 2, hub.ranges
    local = run_local(big.path, tmp_path)
    assert proc.stdout == local.stdout and local.stdout, local.stderr


def test_stalled_endpoint_is_offline_within_the_timeout(hub, sources, tmp_path):
    """A Hub that takes the connection and never answers is offline after CONNECT_TIMEOUT_S:
    a name downloaded before runs from the cache, another is one line; neither hangs."""
    assert run_hub(hub, tmp_path, f"{GGUF_REPO}:Q8_0", *GENERATE).returncode == 0
    with socket.socket() as stalled:  # listens, never accepts: connections wait in its backlog
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)
        hub.url = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        t0 = time.monotonic()
        cached = run_hub(hub, tmp_path, f"{GGUF_REPO}:Q8_0", *GENERATE)
        took = time.monotonic() - t0
        assert cached.returncode == 0 and cached.stdout, cached.stderr
        assert CONNECT_TIMEOUT_S <= took < CONNECT_TIMEOUT_S + 20, took
        line = assert_one_error_line(run_hub(hub, tmp_path, HF_REPO, *GENERATE), "not downloaded yet")
        assert hub.url in line, line


def test_serve_by_name(hub, sources, tmp_path):
    """`pycalm serve ORG/NAME`: served under the Hub name, with the local folder's tokens."""
    port = _free_port()
    env = {**_env(), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "pycalm.serve", HF_REPO, "--port", str(port), "--device", "cpu", "-c", "64"]
    cmd += ["--cache-dir", str(tmp_path / "cache")]
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 60)
        models = httpx.get(f"{url}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == [HF_REPO]
        body = {"model": HF_REPO, "prompt": "the cat", "max_tokens": 8, "temperature": 0}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    local = run_local(sources["hf"], tmp_path)
    assert local.stdout == text + "\n" and text, (text, local.stdout)  # the CLI ends with a newline


# ---------------------------------------------------------------------------------------------
# names and files, without a server


def test_parse_hub_name():
    assert parse_hub_name("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert parse_hub_name("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M") == (
        "bartowski/Qwen2.5-0.5B-Instruct-GGUF",
        "Q4_K_M",
    )
    assert parse_hub_name("hf.co/a/b:q8_0") == ("a/b", "q8_0")
    assert parse_hub_name("https://huggingface.co/a/b") == ("a/b", None)
    for not_a_name in ("smollm2", "/abs/path", "./a/b", "a/b/c", "a/b:", "a b/c", "../x/y", "a/b.gguf:x:y"):
        assert parse_hub_name(not_a_name) is None, not_a_name


def test_choose_files():
    files = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "onnx/model.safetensors",
        "x.bin",
    ]
    assert choose_files("a/b", None, files) == ("hf", ["config.json", "model.safetensors", "tokenizer.json"])
    ggufs = ["M-Q4_K_M.gguf", "M-Q4_K_S.gguf", "M.Q8_0.gguf", "f16/M-F16-00001-of-00002.gguf"]
    assert [gguf_tag(f) for f in ggufs] == ["Q4_K_M", "Q4_K_S", "Q8_0", "F16"]
    assert choose_files("a/b", "q4_k_m", ggufs) == ("gguf", ["M-Q4_K_M.gguf"])
    assert choose_files("a/b", None, ggufs) == ("gguf", ["M-Q4_K_M.gguf"])  # ollama's default
    assert choose_files("a/b", "Q8", ggufs) == ("gguf", ["M.Q8_0.gguf"])  # by substring, unique
    with pytest.raises(PycalmError, match="matches 2 GGUF files .*its tags: F16, Q4_K_M, Q4_K_S, Q8_0$"):
        choose_files("a/b", "Q4_K", ggufs)
    with pytest.raises(PycalmError, match="no GGUF files"):
        choose_files("a/b", "Q4_K_M", files)
    with pytest.raises(PycalmError, match="neither safetensors"):
        choose_files("a/b", None, ["README.md", "x.bin"])


def test_hub_environment_is_documented():
    """The variables the hub path honours are named where a user looks (the module's docstring
    and the README)."""
    import pycalm.app.hub as hub_module

    readme = (REPO / "README.md").read_text()
    for var in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN"):
        assert var in hub_module.__doc__ and var in readme, var
