"""q8 and q4 models: GGUF blocks transcoded exactly, the converter's files, the mixed-precision
policy, the calibration, and the all-rows forward it measures with.

Expected values come from the `gguf` package's own quantizer and dequantizer (Q4_0, Q4_1,
Q8_0) or from Q4_K blocks built here byte by byte, and from the CPU engine's token path.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_gguf, make_hf_llama  # noqa: E402

from pycalm.convert import calibrate, quantize
from pycalm.convert.main import convert, main  # noqa: E402
from pycalm.cpu.engine import CpuEngine  # noqa: E402
from pycalm.errors import PycalmError  # noqa: E402
from pycalm.model import formats  # noqa: E402
from pycalm.model.loader import open_model  # noqa: E402

# ---------------------------------------------------------------------------------------------
# GGUF blocks -> q4


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1])
def test_q4_0_and_q4_1_transcode_exactly(qtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 160)) * rng.uniform(1e-3, 2, (5, 1))).astype(np.float32)
    raw = quants.quantize(x, qtype)  # llama.cpp's blocks, (rows, bytes)
    q, rounded = quantize.q4_from_gguf(raw, qtype.name, 160)
    assert rounded == 0 and q.scales.shape == (5, 5, 2)
    np.testing.assert_array_equal(formats.decode(q, "q4"), quants.dequantize(raw, qtype))


def q4_k_blocks(rng, rows: int, cols: int, d: float, dmin: float) -> np.ndarray:
    """Random Q4_K super-blocks (rows, cols // 256 * 144) with the given fp16 d and dmin."""
    b = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    b[..., 0:2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    b[..., 2:4] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def test_q4_k_transcodes_exactly_on_the_fp16_grid():
    # d and dmin powers of two: every d * sc and dmin * mn (6-bit sc, mn) is an fp16 number
    raw = q4_k_blocks(np.random.default_rng(1), 3, 512, 2.0**-10, 2.0**-12)
    q, rounded = quantize.q4_from_gguf(raw, "Q4_K", 512)
    assert rounded == 0
    np.testing.assert_array_equal(formats.decode(q, "q4"), quants.dequantize(raw, T.Q4_K))


def test_q4_k_off_the_grid_rounds_scales_once():
    raw = q4_k_blocks(np.random.default_rng(2), 3, 512, 0.0123, 0.00456)
    q, rounded = quantize.q4_from_gguf(raw, "Q4_K", 512)
    assert 0 < rounded <= 3 * 16
    want = quants.dequantize(raw, T.Q4_K)
    got = formats.decode(q, "q4")
    # the codes are kept; d and m carry one fp16 rounding (2**-11 relative) each
    bound = (15 * 0.0123 * 63 + 0.00456 * 63) * 2.0**-11 * 1.01
    assert 0 < np.abs(got - want).max() <= bound


# ---------------------------------------------------------------------------------------------
# the converter


def stored(m, name: str) -> np.ndarray:
    return formats.decode(m.tensor(name), m.config.dtype_of(name))


def matrix_bytes(m) -> tuple[int, int]:
    """(bytes of every matrix with its scales, weights) as the file holds them."""
    nbytes = weights = 0
    for name, (n, _) in quantize.matrix_shapes(m.config).items():
        t = m.tensor(name)
        nbytes += sum(a.nbytes for a in t) if isinstance(t, formats.Quantized) else t.nbytes
        weights += n
    return nbytes, weights


def test_gguf_q4_1_to_q4_no_policy(tmp_path):
    """Every Q4_1 matrix comes out as the GGUF's own blocks; the F16 embedding is quantized."""
    tiny = make_gguf(tmp_path, qtype="Q4_1", tie=True)
    out = convert(tiny.path, tmp_path / "m.safetensors", "q4", progress=False, policy=False)
    import gguf

    blocks = {t.name: t for t in gguf.GGUFReader(tiny.path).tensors}
    with open_model(out) as m:
        assert m.config.tensor_dtypes == () and m.config.q4_groups == ()
        for layer in range(2):
            p, b = f"layers.{layer}.", f"blk.{layer}."
            for name, src in (("wo", "attn_output"), ("w1", "ffn_gate"), ("w2", "ffn_down")):
                t = blocks[b + src + ".weight"]
                want = quants.dequantize(t.data, t.tensor_type).reshape(m.tensor(p + name).codes.shape[0], -1)
                np.testing.assert_array_equal(stored(m, p + name), want)
        emb = tiny.weights["token_embd.weight"]
        np.testing.assert_array_equal(
            stored(m, "tok_embeddings"), formats.decode(formats.encode(emb, "q4"), "q4")
        )
        nbytes, weights = matrix_bytes(m)
        assert nbytes * 8 / weights == quantize.average_bits(m.config) == 5.0


def test_gguf_q8(tmp_path):
    tiny = make_gguf(tmp_path, arch="qwen2", qtype="Q8_0", tie=False)
    out = convert(tiny.path, tmp_path / "m.safetensors", "q8", progress=False)
    w = tiny.weights
    with open_model(out) as m:
        assert m.config.weight_dtype == "q8"
        t = m.tensor("layers.1.w2")
        assert t.codes.dtype == np.int8 and t.scales.shape == (64,)
        # Q8_0 values (exact in float32) quantized once, to the nearest code of the row's scale
        np.testing.assert_array_equal(
            stored(m, "layers.1.w2"), formats.decode(formats.encode(w["blk.1.ffn_down.weight"], "q8"), "q8")
        )
        assert (
            np.abs(stored(m, "output") - w["output.weight"]).max()
            <= m.tensor("output").scales.max() / 2 * 1.0001
        )
        nbytes, weights = matrix_bytes(m)
        assert nbytes * 8 / weights == pytest.approx(quantize.average_bits(m.config))


@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_hf_bf16_to_q8_and_q4(tmp_path, dtype):
    """A Hugging Face bf16 checkpoint: every matrix is its source encoded once (q4 without the
    policy: groups of 32)."""
    tiny = make_hf_llama(tmp_path, arch="qwen2", dtype="bfloat16", dim=64, hidden_dim=64)
    out = convert(tiny.path, tmp_path / "m.safetensors", dtype, progress=False, policy=False)
    w = tiny.weights
    with open_model(out) as m:
        assert m.config.weight_dtype == dtype
        for name, src in [
            ("tok_embeddings", "model.embed_tokens.weight"),
            ("output", "lm_head.weight"),
            ("layers.1.wo", "model.layers.1.self_attn.o_proj.weight"),
            ("layers.0.w1", "model.layers.0.mlp.gate_proj.weight"),
            ("layers.1.w2", "model.layers.1.mlp.down_proj.weight"),
            ("layers.0.w3", "model.layers.0.mlp.up_proj.weight"),
        ]:
            want = formats.decode(formats.encode(w[src], dtype), dtype)
            np.testing.assert_array_equal(stored(m, name), want, err_msg=name)


def test_policy_q4_1_tied(tmp_path):
    """Layers on the grid stay as transcoded; the tied embedding (F16, fresh) is the only
    matrix the policy moves: q8 does not fit 5.0 bits (5.22), groups of 32 do (5.0); at 5.3
    bits it goes to q8."""
    tiny = make_gguf(tmp_path, qtype="Q4_1", tie=True)
    with open_model(convert(tiny.path, tmp_path / "a.safetensors", "q4", progress=False)) as m:
        assert m.config.tensor_dtypes == () and m.config.q4_groups == ()
        assert quantize.average_bits(m.config) == 5.0
    with open_model(convert(tiny.path, tmp_path / "b.safetensors", "q4", progress=False, bits=5.3)) as m:
        assert m.config.tensor_dtypes == (("tok_embeddings", "q8"),)
        assert quantize.average_bits(m.config) == pytest.approx((4096 * 8.5 + 61440 * 5) / 65536)
        emb = tiny.weights["token_embd.weight"]
        np.testing.assert_array_equal(
            stored(m, "tok_embeddings"), formats.decode(formats.encode(emb, "q8"), "q8")
        )


def test_policy_fresh_untied(tmp_path):
    """Every matrix fresh (Q8_0 source), classifier untied, 5.0 bits: start in groups of 64
    (w2's rows of 96 only fit 32); the classifier to q8 (4.82 bits); the w2s to q8 do not fit;
    then groups of 32 in order: the embedding, layer 0's wqkv, wo, w1 (4.985); layer 0's w3 and
    every later one would pass 5.0."""
    tiny = make_gguf(tmp_path, arch="qwen2", qtype="Q8_0", tie=False)
    logs = []
    out = convert(tiny.path, tmp_path / "m.safetensors", "q4", progress=False, log=logs.append)
    with open_model(out) as m:
        c = m.config
        assert c.tensor_dtypes == (("output", "q8"),)
        in_64 = {"layers.0.w3", "layers.1.wqkv", "layers.1.wo", "layers.1.w1", "layers.1.w3"}
        assert dict(c.q4_groups) == dict.fromkeys(in_64, 64)
        assert quantize.average_bits(c) == pytest.approx(347136 / 69632)
        nbytes, weights = matrix_bytes(m)
        assert nbytes * 8 / weights == pytest.approx(347136 / 69632)
        assert m.tensor("layers.1.w1").scales.shape == (96, 1, 2)
        assert m.tensor("layers.0.w1").scales.shape == (96, 2, 2)
    assert logs[-1].startswith("4.985 bits a weight") and "1 matrices in q8, 5 in q4 groups of 64" in logs[-1]
    assert any("Q8_0 quantized once" in line for line in logs)


def test_calibrated_policy_and_cli(tmp_path, capsys):
    tiny = make_gguf(tmp_path, arch="qwen2", qtype="Q8_0", tie=False)
    text = tmp_path / "cal.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(300)))
    out = tmp_path / "m.safetensors"
    rc = main(
        [str(tiny.path), str(out), "--dtype", "q4", "--calibrate", str(text), "--quiet", "--bits", "5.2"]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "calibrate: output in q4 (groups of 64): KL" in err
    with open_model(out) as m:
        assert 4.5 < quantize.average_bits(m.config) <= 5.2
    # the ranking: one q8 step for every fresh matrix and a groups-of-32 step where 64 fit
    from pycalm.convert.main import plan_conversion

    conv = plan_conversion(tiny.path, "q4")
    steps = calibrate.rank_steps(conv, text, set())
    assert sorted(s.name for s in steps if s.dtype == "q8") == sorted(quantize.matrix_shapes(conv.config))
    assert {s.name for s in steps if s.dtype == "q4"} == {
        n for n, (_, cols) in quantize.matrix_shapes(conv.config).items() if cols % 64 == 0
    }
    with pytest.raises(PycalmError, match="use it with --dtype q4"):
        convert(tiny.path, tmp_path / "x.safetensors", "q8", progress=False, calibrate=text)


# ---------------------------------------------------------------------------------------------
# the all-rows forward against the CPU engine's token path


@pytest.mark.parametrize("arch,dtype", [("llama", "q4"), ("qwen2", "q8")])
def test_forward_rows_matches_token_path(tmp_path, arch, dtype):
    tiny = make_gguf(tmp_path, arch=arch, qtype="Q4_0", tie=arch == "llama")
    with open_model(convert(tiny.path, tmp_path / "m.safetensors", dtype, progress=False)) as m:
        ids = [1, 5, 9, 3, 60, 7, 7, 2, 40, 11]
        engine = CpuEngine(m, seq_len=16)
        want = np.stack([engine.logits(t, pos) for pos, t in enumerate(ids)])
        w = calibrate.model_weights(m)
        hidden = calibrate.forward_rows(m.config, w, np.asarray(ids))
        got = hidden @ calibrate.classifier(m.config, w).T
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        logp = want.astype(np.float64) - np.log(np.exp(want.astype(np.float64)).sum(1, keepdims=True))
        nll = -np.mean(logp[np.arange(9), ids[1:]])
        assert calibrate.mean_nll(m.config, w, ids) == pytest.approx(nll, rel=1e-5)
