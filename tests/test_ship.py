"""scripts/ship.sh: a file in pieces to the GPU machine, joined and checked there (run here, both
sides in temporary folders)."""

import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ship.sh"


def ship(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_pieces_join_into_the_file_and_a_missing_piece_is_refused(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 2_500_000, dtype=np.uint8).tobytes()
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    env = dict(os.environ, SHIP_OUT=str(tmp_path / "out"), SHIP_DIR=str(tmp_path / "kept"), SHIP_PIECE="1M")

    split = ship("split", str(src), env=env)
    assert split.returncode == 0, split.stderr
    pieces = sorted((tmp_path / "out").iterdir())
    assert [p.name for p in pieces] == ["model.gguf.00", "model.gguf.01", "model.gguf.02"]
    assert split.stdout.count("put: carry") == 3 and f"join model.gguf {want}" in split.stdout

    for piece in pieces[:2]:  # the last piece never arrives
        assert ship("put", str(piece), env=env).returncode == 0
    dest = tmp_path / "there" / "model.gguf"
    short = ship("join", "model.gguf", want, str(dest), env=env)
    assert short.returncode != 0 and not dest.exists() and not dest.with_name("model.gguf.part").exists()
    assert short.stderr.count("\n") == 1 and "sha256" in short.stderr

    assert ship("put", str(pieces[2]), env=env).returncode == 0
    joined = ship("join", "model.gguf", want, str(dest), env=env)
    assert joined.returncode == 0, joined.stderr
    assert dest.read_bytes() == data


def test_bad_input_gets_one_line(tmp_path):
    env = dict(os.environ, SHIP_OUT=str(tmp_path / "out"), SHIP_DIR=str(tmp_path / "kept"))
    for args, says in [
        (("split", str(tmp_path / "absent")), "no file"),
        (("put", str(tmp_path / "absent.00")), "no piece"),
        (("join", "absent", "0" * 64, str(tmp_path / "d")), "no pieces of absent"),
        (("frobnicate",), "usage"),
    ]:
        r = ship(*args, env=env)
        assert r.returncode != 0 and says in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
