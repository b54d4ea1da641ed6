"""Model-file reader and writer tests: round trip, safetensors compatibility, and every way a
file can be wrong (missing, truncated, garbage, foreign, mismatched) giving a one-line error."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pycalm.errors import PycalmError
from pycalm.model import formats
from pycalm.model.config import ModelConfig
from pycalm.model.loader import ModelWriter, expected_tensors, open_model, write_model

TOKENIZER = b'{"model": "tiny"}'


def tiny_config(**changes) -> ModelConfig:
    base = ModelConfig(
        arch="qwen2",
        dim=24,
        hidden_dim=40,
        head_dim=6,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=50,
        max_seq_len=128,
        rope_theta=10000.0,
        rotary_dim=6,
        norm_eps=1e-6,
        bos_id=-1,
        eos_ids=(3, 4),
        qkv_bias=True,
        weight_dtype="fp16",
    )
    return base.replace(**changes)


def random_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Stored arrays for every tensor but the tokenizer, encoded from random floats."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in expected_tensors(config, len(TOKENIZER))[:-1]:
        if spec.dtype == np.float32:
            out[spec.name] = rng.standard_normal(spec.shape).astype(np.float32)
        else:
            cols = spec.shape[-1] * (8 if config.weight_dtype == "gf4" else 1)
            x = rng.standard_normal((*spec.shape[:-1], cols)).astype(np.float32)
            out[spec.name] = formats.encode(x, config.weight_dtype)
    return out


def write(path, config, tensors=None):
    tensors = tensors if tensors is not None else random_tensors(config)
    return write_model(path, config, iter(tensors.items()), "tokenizers-json", TOKENIZER, "TEMPLATE"), tensors


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "gf4"])
@pytest.mark.parametrize("moe", [False, True])
def test_round_trip(tmp_path, dtype, moe):
    changes = {"weight_dtype": dtype}
    if moe:
        changes.update(arch="mixtral", n_experts=3, n_experts_active=2, qkv_bias=False, tied_embeddings=True)
    config = tiny_config(**changes)
    path, tensors = write(tmp_path / "m.safetensors", config)
    assert not (tmp_path / "m.safetensors.tmp").exists()
    with open_model(path) as m:
        assert m.config == config
        assert m.tokenizer_kind == "tokenizers-json" and m.tokenizer_blob == TOKENIZER
        assert m.chat_template == "TEMPLATE"
        assert m.names() == [s.name for s in expected_tensors(config, len(TOKENIZER))]
        assert m.has("layers.1.wqkv") and not m.has("layers.2.wqkv")
        assert m.has("output") != moe and m.has("layers.0.moe_gate") == moe
        for name, arr in tensors.items():
            got = m.tensor(name)
            assert got.dtype == arr.dtype and got.shape == arr.shape
            np.testing.assert_array_equal(got, arr)
        with pytest.raises(PycalmError, match="no tensor 'nope'"):
            m.tensor("nope")
    with pytest.raises(PycalmError, match="already closed"):
        m.tensor("norm")
    # plain safetensors: the library reads it, and the header is padded to 8 bytes
    assert set(load_file(path)) == set(tensors) | {"tokenizer"}
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0


def test_shapes(tmp_path):
    config = tiny_config(weight_dtype="gf4")
    specs = {s.name: s for s in expected_tensors(config, 7)}
    assert specs["tok_embeddings"].shape == (50, 3) and specs["tok_embeddings"].dtype == np.uint32
    assert specs["layers.0.wqkv"].shape == (4 * 6 + 2 * 2 * 6, 3)
    assert specs["layers.0.bqkv"].shape == (48,)
    assert specs["layers.0.wo"].shape == (24, 3)
    assert specs["layers.0.w2"].shape == (24, 5)
    assert specs["rope_freqs"].shape == (3,)
    assert specs["tokenizer"].shape == (7,)
    with pytest.raises(
        PycalmError, match="layers.0.wo: gf4 needs rows whose length is a multiple of 8, got 20"
    ):
        expected_tensors(tiny_config(weight_dtype="gf4", head_dim=5, rotary_dim=4), 7)


def test_writer_chunks_and_order(tmp_path):
    config = tiny_config()
    tensors = random_tensors(config)
    with ModelWriter(tmp_path / "m.safetensors", config, "sentencepiece", b"SP", "") as w:
        for spec in w.pending():
            arr = tensors[spec.name]
            for r0 in range(0, arr.shape[0], 7):  # row chunks
                w.write(spec.name, arr[r0 : r0 + 7])
    with open_model(tmp_path / "m.safetensors") as m:
        assert m.tokenizer_kind == "sentencepiece" and m.tokenizer_blob == b"SP"
        np.testing.assert_array_equal(m.tensor("tok_embeddings"), tensors["tok_embeddings"])
    with pytest.raises(ValueError, match="next tensor in the file is 'tok_embeddings'"):
        write_model(
            tmp_path / "x.safetensors", config, iter([("norm", tensors["norm"])]), "sentencepiece", b""
        )
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.safetensors.tmp").exists()


def test_interrupted_write_leaves_nothing(tmp_path):
    config = tiny_config()
    tensors = random_tensors(config)
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"old")  # an earlier file under the final name survives a failed conversion
    with pytest.raises(KeyboardInterrupt):
        with ModelWriter(out, config, "sentencepiece", b"SP") as w:
            w.write("tok_embeddings", tensors["tok_embeddings"])
            raise KeyboardInterrupt
    assert out.read_bytes() == b"old" and not (tmp_path / "m.safetensors.tmp").exists()
    with pytest.raises(ValueError, match="not written"):
        with ModelWriter(out, config, "sentencepiece", b"SP") as w:
            w.write("tok_embeddings", tensors["tok_embeddings"])
    assert out.read_bytes() == b"old"


# ---------------------------------------------------------------------------------------------
# bad files


def test_missing(tmp_path):
    with pytest.raises(PycalmError, match="model file not found: .*nope.safetensors"):
        open_model(tmp_path / "nope.safetensors")


def test_truncated(tmp_path):
    path, _ = write(tmp_path / "m.safetensors", tiny_config())
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PycalmError, match=r"cut.safetensors: truncated: tensor '.*' ends at byte \d+"):
        open_model(cut)
    cut.write_bytes(data[:-1])  # one byte short: the tokenizer, last in the file, is cut
    with pytest.raises(PycalmError, match="truncated: tensor 'tokenizer'"):
        open_model(cut)
    cut.write_bytes(data[:100])  # inside the header
    with pytest.raises(PycalmError, match="not a safetensors file or truncated"):
        open_model(cut)
    cut.write_bytes(data[:5])
    with pytest.raises(PycalmError, match="not a safetensors file"):
        open_model(cut)


def test_garbage(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(PycalmError, match="bad.safetensors: not a safetensors file"):
        open_model(bad)
    header = b"{this is not json}      "
    bad.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(PycalmError, match="bad.safetensors: corrupt safetensors header"):
        open_model(bad)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(PycalmError, match=r"tensor 'x': offsets 0..12 disagree with F32 \(4,\)"):
        open_model(bad)


def test_foreign_safetensors(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"a": np.zeros(3, np.float32)}, str(path))
    with pytest.raises(PycalmError, match="plain.safetensors: not a pycalm model file"):
        open_model(path)


def rewrite(path, out, tensors=None, meta_changes=None):
    """Write a safetensors file with pycalm metadata from `path` but different tensors/metadata."""
    src = load_file(path)
    from safetensors import safe_open

    with safe_open(str(path), "numpy") as f:
        meta = dict(f.metadata())
    meta.update(meta_changes or {})
    src.update(tensors or {})
    save_file({k: v for k, v in src.items() if v is not None}, str(out), metadata=meta)
    return out


def test_mismatched_tensors(tmp_path):
    config = tiny_config()
    path, tensors = write(tmp_path / "m.safetensors", config)
    bad = tmp_path / "bad.safetensors"
    rewrite(path, bad, {"layers.1.wo": np.zeros((24, 23), np.float16)})
    with pytest.raises(PycalmError, match=r"tensor 'layers.1.wo' is F16 \[24, 23\], expected F16 \[24, 24\]"):
        open_model(bad)
    rewrite(path, bad, {"layers.0.w1": np.zeros((40, 24), np.uint8)})
    with pytest.raises(PycalmError, match=r"'layers.0.w1' is U8 \[40, 24\], expected F16 \[40, 24\].*fp16"):
        open_model(bad)
    rewrite(path, bad, {"layers.1.bqkv": None})
    with pytest.raises(PycalmError, match="bad.safetensors: missing tensor 'layers.1.bqkv'"):
        open_model(bad)


def test_bad_metadata(tmp_path):
    path, _ = write(tmp_path / "m.safetensors", tiny_config())
    bad = tmp_path / "bad.safetensors"
    rewrite(path, bad, meta_changes={"pycalm.config": "{not json"})
    with pytest.raises(PycalmError, match="bad model config in metadata"):
        open_model(bad)
    cfg = json.loads(tiny_config().to_json())
    cfg["arch"] = "gpt2"
    rewrite(path, bad, meta_changes={"pycalm.config": json.dumps(cfg)})
    with pytest.raises(PycalmError, match="unsupported architecture 'gpt2'"):
        open_model(bad)
    rewrite(path, bad, meta_changes={"pycalm.tokenizer": "wordpiece"})
    with pytest.raises(PycalmError, match="unknown tokenizer kind 'wordpiece'"):
        open_model(bad)
    rewrite(path, bad, meta_changes={"pycalm.format_version": "2"})
    with pytest.raises(PycalmError, match="pycalm format version '2'"):
        open_model(bad)


def test_lying_header_entries(tmp_path):
    """Sizes in the header are checked as Python integers before anything is sized by them."""
    bad = tmp_path / "bad.safetensors"

    def header_file(header: object, raw: bytes | None = None) -> None:
        raw = raw if raw is not None else json.dumps(header).encode()
        bad.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))

    # (2**40)**2 float32 values wrap to 0 bytes in int64: not here
    header_file({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 0]}})
    with pytest.raises(PycalmError, match=r"tensor 'x': offsets 0..0 disagree with F32 \(1099511627776, "):
        open_model(bad)
    for entry in ({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}, {"dtype": "F32", "shape": "4"}):
        header_file({"x": entry})
        with pytest.raises(PycalmError, match="corrupt safetensors header entry for tensor 'x'"):
            open_model(bad)
    header_file(None, b"[" * 100_000)  # nested past Python's recursion limit
    with pytest.raises(
        PycalmError, match=r"bad.safetensors: corrupt safetensors header \(JSON nested too deep\)"
    ):
        open_model(bad)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("n_layers", 10**12, r"config has 1000000000000 layers but the file only \d+ tensors"),
        ("n_kv_heads", 0, "bad model config in metadata: n_kv_heads is 0"),
        ("dim", "24", "bad model config in metadata: dim = '24'"),
        ("norm_eps", -1.0, r"bad model config in metadata: norm_eps = -1.0"),
        ("eos_ids", [3, 50], "bos_id or eos_ids past the vocabulary"),
    ],
)
def test_lying_config(tmp_path, field, value, message):
    """A config whose values lie about the file is one line naming the file, before any tensor
    list is sized by it (a lying n_layers once listed 10**13 tensors)."""
    path, _ = write(tmp_path / "m.safetensors", tiny_config())
    cfg = json.loads(tiny_config().to_json())
    cfg[field] = value
    bad = rewrite(path, tmp_path / "bad.safetensors", meta_changes={"pycalm.config": json.dumps(cfg)})
    with pytest.raises(PycalmError, match=message) as e:
        open_model(bad)
    assert str(e.value).startswith(f"{bad}: ") and "\n" not in str(e.value)


def test_error_message_is_one_line():
    """A wrapped library's message of several lines reaches the CLI as one line."""
    assert (
        str(PycalmError("cannot read:\n  line two\r\nline three\n")) == "cannot read:; line two; line three"
    )
