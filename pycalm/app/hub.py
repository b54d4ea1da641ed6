"""Models by their Hugging Face name, downloaded with huggingface_hub into its own cache.

    pycalm generate HuggingFaceTB/SmolLM2-135M-Instruct            safetensors, converted once
    pycalm generate bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M    the one GGUF file tagged Q4_K_M

A MODEL argument that is not a path on disk and reads `ORG/NAME` or `ORG/NAME:TAG` (an `hf.co/`
or `https://huggingface.co/` in front is allowed, as ollama allows it) names a model repository on
the Hub. Without a tag, the files a Hugging Face folder is converted from (pycalm.convert.hf) are
downloaded: config.json, the top-level *.safetensors, tokenizer.json or tokenizer.model,
tokenizer_config.json, generation_config.json and chat_template.jinja where the repository has
them. With a tag, the one GGUF file whose quant tag (the last `-` or `.` part of its name, before
.gguf: Q4_K_M in Model-Q4_K_M.gguf) is TAG, compared case-insensitively; failing that, the one whose
name holds TAG. No match, or several, is an error that lists the repository's tags. A repository
with GGUF files only and no tag given: its one GGUF file, or its Q4_K_M one (ollama's default).

The downloads are huggingface_hub's (snapshot_download): its cache (~/.cache/huggingface/hub, or
$HF_HOME/hub), a dropped connection taken up again where the file stopped (a Range request),
files already there never fetched again, progress bars on a terminal, the token of `hf auth login`
or $HF_TOKEN for private and gated models, $HF_ENDPOINT for another server (a mirror). The Hub is
asked first what the repository holds (within CONNECT_TIMEOUT_S); when it cannot be reached, or
$HF_HUB_OFFLINE=1, the files of the name's last download are used as they are, without a
connection; a name never downloaded is then one error line. The result is a local folder or GGUF
file that pycalm.app.models converts as it converts any other (pycalm.app.cache).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from pycalm.errors import PycalmError

CONNECT_TIMEOUT_S = 5.0  # asking the Hub what a repository holds (connect, then answer): past this, offline
HUB_NAME = re.compile(
    r"(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?"  # ollama's hf.co/ORG/NAME, or a Hub address
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"  # ORG/NAME, as the Hub spells repository ids
    r"(?::(?P<tag>[\w.-]+))?"  # :TAG picks a GGUF file
)
# the files of a Hugging Face folder that pycalm.convert.hf reads, besides the *.safetensors
HF_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)
DEFAULT_TAG = "Q4_K_M"  # ollama's pick among a repository's GGUF files when no tag is given
SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}$")  # llama.cpp's split GGUF files: Model-Q8_0-00001-of-00003


def parse_hub_name(arg: str) -> tuple[str, str | None] | None:
    """(ORG/NAME, TAG or None) when `arg` reads as a Hub model name, else None. Says nothing of
    whether such a repository exists, or whether `arg` is also a path (the caller asks first)."""
    m = HUB_NAME.fullmatch(arg)
    return (m["repo"], m["tag"]) if m else None


# ---------------------------------------------------------------------------------------------
# which files of a repository


def gguf_tag(path: str) -> str:
    """The quant tag of a GGUF file's name: its last `-` or `.` part (Q4_K_M of Model-Q4_K_M.gguf,
    of Model.Q4_K_M.gguf and of Model-Q4_K_M-00001-of-00002.gguf)."""
    stem = SPLIT_PART.sub("", Path(path).name[: -len(".gguf")])
    return re.split(r"[-.]", stem)[-1]


def _tags(ggufs: list[str]) -> str:
    return ", ".join(sorted({gguf_tag(f) for f in ggufs}, key=str.lower)) or "none"


def choose_files(repo: str, tag: str | None, files: list[str]) -> tuple[str, list[str]]:
    """("hf", the files of a Hugging Face folder) or ("gguf", [the GGUF file]) of a repository
    holding `files` (paths in the repository), for ORG/NAME (tag None) or ORG/NAME:TAG."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if tag is not None:
        if not ggufs:
            raise PycalmError(
                f"{repo}:{tag}: {repo} has no GGUF files for a tag to pick (name it without :{tag})"
            )
        picked = [f for f in ggufs if gguf_tag(f).lower() == tag.lower()]
        picked = picked or [f for f in ggufs if tag.lower() in Path(f).name.lower()]
        if not picked:
            raise PycalmError(f"{repo} has no GGUF file tagged {tag}; its tags: {_tags(ggufs)}")
        if len(picked) > 1:
            raise PycalmError(
                f"{repo}:{tag} matches {len(picked)} GGUF files ({', '.join(picked)}), one is needed; "
                f"its tags: {_tags(ggufs)}"
            )
        return "gguf", picked
    top = [f for f in files if "/" not in f]  # pycalm.convert.hf reads the folder's top level
    weights = [f for f in top if f.endswith(".safetensors")]
    if weights and "config.json" in top:
        return "hf", sorted(weights + [f for f in top if f in HF_FILES])
    if len(ggufs) == 1:
        return "gguf", ggufs
    default = [f for f in ggufs if gguf_tag(f).lower() == DEFAULT_TAG.lower()]
    if len(default) == 1:
        return "gguf", default
    if ggufs:
        raise PycalmError(
            f"{repo} holds {len(ggufs)} GGUF files: pick one as {repo}:TAG; its tags: {_tags(ggufs)}"
        )
    raise PycalmError(f"{repo} holds neither safetensors weights with a config.json nor a GGUF file")


# ---------------------------------------------------------------------------------------------
# the Hub, or the cache when it cannot be reached


def _refused(arg: str, repo: str, error: Exception, endpoint: str) -> PycalmError | None:
    """The one-line error for the Hub's refusal (a missing, private or gated repository, another
    HTTP error); None for anything else (no connection, offline mode)."""
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(error, GatedRepoError):
        return PycalmError(
            f"{repo} is a gated model: accept its conditions on its page on the Hub, then log in "
            "(`hf auth login`, or set HF_TOKEN)"
        )
    if not isinstance(error, HfHubHTTPError):
        return None
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(error, RepositoryNotFoundError) or status in (401, 404):
        return PycalmError(
            f"model not found: {arg} (not a file or folder here, and {endpoint} has no model {repo} "
            "that this login may read; a private one needs `hf auth login` or HF_TOKEN)"
        )
    return PycalmError(f"cannot download {repo}: {endpoint} answered HTTP {status}")


def _snapshot(repo: str, commit: str | None = None) -> tuple[Path, list[str]] | None:
    """The snapshot folder of `repo` at `commit` (default: the one the cache's refs/main names,
    the last download) in huggingface_hub's documented cache layout, and the files it holds;
    None when nothing of it is there."""
    from huggingface_hub import constants

    storage = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    try:
        commit = commit or (storage / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snapshot = storage / "snapshots" / commit
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    return (snapshot, files) if files else None


def _why(error: BaseException) -> str:
    """What went wrong, in the innermost cause's words (the OS's own: "Connection refused")."""
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
    return getattr(cause, "strerror", None) or str(cause) or type(cause).__name__


def _offline_reason(error: Exception, endpoint: str) -> str:
    """Why the Hub was not asked, in words."""
    from huggingface_hub.utils import OfflineModeIsEnabled

    if isinstance(error, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set"
    return f"cannot connect to {endpoint}: {_why(error)}"


def hub_model(arg: str, log: Callable[[str], None]) -> tuple[Path, str, str]:
    """The local source of the Hub model `arg` (ORG/NAME[:TAG], see parse_hub_name): its snapshot
    folder (safetensors) or its GGUF file, downloaded the first time; the name its conversion is
    cached under, and where it came from in words. Every failure is a PycalmError of one line."""
    from huggingface_hub import HfApi, constants

    parsed = parse_hub_name(arg)
    if parsed is None:
        raise PycalmError(f"model not found: {arg}")
    repo, tag = parsed
    endpoint = constants.ENDPOINT
    try:
        info = HfApi().model_info(repo, timeout=CONNECT_TIMEOUT_S)
        files, commit, offline = [s.rfilename for s in info.siblings or []], info.sha, None
    except Exception as e:  # noqa: BLE001 (HTTP errors are sorted below; the rest is no connection)
        refused = _refused(arg, repo, e, endpoint)
        if refused is not None:
            raise refused from None
        if isinstance(e, ValueError):  # huggingface_hub's own check of the name (no "--", "..")
            raise PycalmError(
                f"model not found: {arg} (not a file or folder, nor a Hub name: {_why(e)})"
            ) from None
        offline = _offline_reason(e, endpoint)
        cached = _snapshot(repo)
        if cached is None:
            raise PycalmError(
                f"{arg} is not downloaded yet and the Hub cannot be asked ({offline})"
            ) from None
        files, commit = cached[1], cached[0].name
    try:
        kind, chosen = choose_files(repo, tag, files)
    except PycalmError as e:
        if offline is None:
            raise
        raise PycalmError(  # the cache holds some of the repository: say what, not what the Hub has
            f"{arg} is not downloaded yet and the Hub cannot be asked ({offline}); "
            f"the cache holds {', '.join(files)} of {repo}"
        ) from e
    have = _snapshot(repo, commit)
    if have is not None and set(chosen) <= set(have[1]):  # downloaded before: used as it is
        folder = have[0]
    else:
        log(
            f"pycalm: fetching {', '.join(chosen)} of {repo} from {endpoint} (once; cached in {constants.HF_HUB_CACHE})"
        )
        folder = _download(arg, repo, chosen, endpoint)
    source = f"{repo} on the Hugging Face Hub, {'offline, ' if offline else ''}commit {commit}"
    if kind == "gguf":
        return folder / chosen[0], Path(chosen[0]).stem, source
    return folder, repo.split("/")[1], source


def _download(arg: str, repo: str, files: list[str], endpoint: str) -> Path:
    """Download `files` of `repo` into huggingface_hub's cache; the snapshot folder holding them."""
    from huggingface_hub import snapshot_download
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        """No progress bars off a terminal (a log file would fill with them), as in pycalm.app.fetch."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "disable": True})

    try:
        bars = None if sys.stderr.isatty() else Quiet  # None: huggingface_hub's own
        folder = Path(snapshot_download(repo, allow_patterns=files, tqdm_class=bars))
    except Exception as e:  # noqa: BLE001
        refused = _refused(arg, repo, e, endpoint)
        if refused is not None:
            raise refused from None
        raise PycalmError(f"cannot download {repo} from {endpoint}: {_why(e)}") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise PycalmError(f"cannot download {repo}: the download lacks {', '.join(missing)}")
    return folder
