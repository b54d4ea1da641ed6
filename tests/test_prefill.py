"""The multi-token forward (pycalm.gpu.prefill, GpuEngine.prefill / prefill_logits) against the
token-by-token path, on tiny random models.

Under the CUDA simulator the token-by-token path is the reference engine (CpuEngine: the GPU's
token step matches it, tests/test_model.py; the simulator's token step costs about 10 s); with
PYCALM_TEST_GPU=1 the GPU's own token step is compared too, and a realistic shape runs. The
prefill rounds the matmuls' activations to fp16 where the token path keeps them float32, so the
logits agree to a relative L2 of 2e-3, not to float32 summation order; greedy tokens must be
identical.

Shapes stay tiny (1-2 layers, dim 32, vocab 64, head_dim 16 for the prefill attention's 16-byte
loads): a tensor-core matmul launch costs about a second under the simulator.
"""

import numpy as np
import pytest
from gpu import GPU, gpu_only
from tiny_models import make_hf_llama

from pycalm.app.perplexity import mean_nll
from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.reference import (
    embed_rows_ref,
    expert_gate_ref,
    expert_matmul_ref,
    kv_round,
    matmul_gate_ref,
    matmul_ref,
    matmul_residual_ref,
    moe_combine_rows_ref,
    moe_route_rows_ref,
    prefill_attention_ref,
    qkv_rows_ref,
    rmsnorm_rows_ref,
)
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.gpu.engine import EngineOptions, GpuEngine
from pycalm.model import formats
from pycalm.model.loader import open_model

GPU_ONLY = gpu_only("realistic shapes")
SEQ_LEN = 32
GREEDY = SamplingParams(temperature=0.0)


def tiny_model(tmp_path, arch: str, dtype: str, n_layers: int = 2, bits: float = 5.0, **kw):
    """A tiny random model converted to dtype (q4: its mixed-precision policy within `bits` a
    weight); q8 / q4 take hidden_dim 64 (q4 groups of 32 columns, q8 loads of 16)."""
    hidden_dim = 64 if dtype in formats.QUANTIZED else 48
    tiny = make_hf_llama(
        tmp_path, arch=arch, dim=32, hidden_dim=hidden_dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, head_dim=16,
        vocab_size=64, **kw,
    )  # fmt: skip
    return open_model(
        convert(tiny.path, tmp_path / f"{arch}-{dtype}.pycalm", dtype, progress=False, bits=bits)
    )


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 64, n)]  # no BOS / EOS ids


class KeptRows(np.ndarray):
    """A KV cache that the reference engine's writes leave as it is (it attends over it)."""

    def __setitem__(self, key, value) -> None:
        pass


def token_path(model, kv: str, ids: list[int], gpu: GpuEngine | None = None, seq_len: int = SEQ_LEN):
    """(len(ids), vocab_size) logits from the reference engine, one token step a position, and
    the engine. With gpu given, the reference attends over gpu's KV cache instead of its own
    (see check_kv)."""
    cpu = CpuEngine(model, seq_len=seq_len, kv_dtype=kv)
    if gpu is not None:
        cpu.ref.key_cache = np.stack([decoded(c.k, kv) for c in gpu.kv_caches]).view(KeptRows)
        cpu.ref.value_cache = np.stack([decoded(c.v, kv) for c in gpu.kv_caches]).view(KeptRows)
    return np.stack([cpu.logits(t, pos) for pos, t in enumerate(ids)]), cpu


def decoded(cache: object, kv: str) -> np.ndarray:
    """A device KV cache (seq_len, kv_dim) as float32."""
    rows = cache.copy_to_host()
    return formats.decode(rows, "fp8") if kv == "fp8" else rows.astype(np.float32)


def check_caches(gpu: GpuEngine, cpu: CpuEngine, kv: str, n: int) -> None:
    """The KV cache rows 0..n-1 the prefill wrote against the token path's (check_kv)."""
    for layer, cache in enumerate(gpu.kv_caches):
        check_kv(decoded(cache.k, kv)[:n], cpu.ref.key_cache[layer, :n], kv)
        check_kv(decoded(cache.v, kv)[:n], cpu.ref.value_cache[layer, :n], kv)


def check_kv(got: np.ndarray, want: np.ndarray, kv: str) -> None:
    """Cache rows against a reference's. fp16: within the fp16-vs-float32 activations' rounding.
    fp8: e5m2 keeps two mantissa bits, so a k or v that differs in the 4th digit lands on the
    neighbouring e5m2 value now and then (a 12-25% step): a few elements may differ, by one e5m2
    step each. Such a step moves the logits by up to about 1% on these tiny models, so with fp8
    the logits are compared with the reference attending over the prefill's own cache
    (token_path with gpu). An element much smaller than its row (a k after RoPE's cancellation)
    carries the row's absolute error, not its own relative one: on the H200 a 6.1e-4 against a
    9.8e-4 in rows of magnitude 1-8 (three e5m2 steps apart, 3.7e-4 of the row's scale), so each
    element may also differ by 2e-3 of its row's rms."""
    if kv == "fp16":
        assert rel_l2(got, want) < 2e-3
    else:
        differ = got != want
        assert differ.mean() < 0.02
        rms = np.sqrt(np.mean(want * want, axis=-1, keepdims=True))
        step = 0.25 * np.maximum(np.abs(got), np.abs(want)) + 2e-3 * rms + 2.0**-16  # e5m2: 2 bits
        assert np.all(np.abs(got - want)[differ] <= step[differ])


def prefill_ref(
    model,
    kv: str,
    ids: list[int],
    over: GpuEngine | list[tuple[np.ndarray, np.ndarray]] | None = None,
    margins: list | None = None,
    hidden: list | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The multi-token forward in NumPy, from pycalm.cpu.reference's row functions in forward_rows's
    order (fp16 activations into the matmuls, as the kernels take them), from position 0:
    logits (T, vocab_size) and the KV caches (n_layers, T, kv_dim), float32. With `over` given,
    attention reads that engine's KV cache rows, or each layer's (keys, values) rows (T, kv_dim)
    float32, instead of its own (fp8: see check_kv). With
    `margins` given (MoE), each MoE layer appends each row's router-logit gap between its k-th
    and (k+1)-th expert (T,): how far the row is from choosing another expert. With `hidden`
    given, the final RMSNorm's rows (T, dim) float32 (the embeddings' input) are appended."""
    cfg, n = model.config, len(ids)
    ref = CpuEngine(model, seq_len=n, kv_dtype=kv).ref  # the weights, decoded

    def mat(name: str) -> np.ndarray:  # a matrix as the tensor cores multiply it
        """q4: decoded (d q + m, float32) then rounded to fp16, the operand the matmul kernels
        build; the other formats decode to values fp16 holds exactly, or (q8) keep the row scale
        for the sums. In the realistic Mixtral q4 model, leaving q4 unrounded moves the logits
        by 1.4e-2 relative L2 (NumPy against NumPy)."""
        w = ref._w(name)
        return formats.fp16_encode(w).astype(np.float32) if cfg.dtype_of(name) == "q4" else w

    x = embed_rows_ref(model.tensor("tok_embeddings"), np.asarray(ids), cfg.dtype_of("tok_embeddings"))
    k_cache = np.zeros((cfg.n_layers, n, cfg.kv_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        xb = rmsnorm_rows_ref(x, ref._w(p + "attn_norm"), cfg.norm_eps)
        qkv = matmul_ref(xb, mat(p + "wqkv"), "fp32")
        bias = ref._w(p + "bqkv") if cfg.qkv_bias else None
        q, k, v = qkv_rows_ref(qkv, bias, 0, ref.rope_freqs, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        k_cache[layer], v_cache[layer] = kv_round(k, kv), kv_round(v, kv)
        keys, values = k_cache[layer], v_cache[layer]
        if isinstance(over, list):
            keys, values = over[layer]
        elif over is not None:
            keys, values = (decoded(c, kv)[:n] for c in (over.kv_caches[layer].k, over.kv_caches[layer].v))
        att = prefill_attention_ref(
            q,
            keys,
            values,
            0,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.head_dim,
            cfg.sliding_window,
        )
        x = matmul_residual_ref(formats.fp16_encode(att), mat(p + "wo"), "fp32", x)
        xb = rmsnorm_rows_ref(x, ref._w(p + "ffn_norm"), cfg.norm_eps)
        w1, w3, w2 = mat(p + "w1"), mat(p + "w3"), mat(p + "w2")
        if cfg.n_experts:  # Mixtral: route, each expert's rows, the weighted sum of the slots
            gate, norm = ref._w(p + "moe_gate"), ref._w(p + "ffn_norm")
            ids, weights = moe_route_rows_ref(gate, x, norm, cfg.norm_eps, cfg.n_experts_active)
            if margins is not None:
                r = np.sort(rmsnorm_rows_ref(x, norm, cfg.norm_eps) @ gate.T, axis=1)
                margins.append(r[:, -cfg.n_experts_active] - r[:, -cfg.n_experts_active - 1])
            y = expert_matmul_ref(expert_gate_ref(xb, w1, w3, "fp32", ids), w2, "fp32", ids)
            x = moe_combine_rows_ref(y, weights, x)
        else:
            x = matmul_residual_ref(matmul_gate_ref(xb, w1, w3, "fp32"), w2, "fp32", x)
    out = "tok_embeddings" if cfg.tied_embeddings else "output"
    if hidden is not None:
        hidden.append(rmsnorm_rows_ref(x, ref.norm, cfg.norm_eps, fp16=False))
    logits = matmul_ref(rmsnorm_rows_ref(x, ref.norm, cfg.norm_eps), mat(out), "fp32")
    return logits, k_cache, v_cache


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize(
    "arch,dtype,kv,n,bits",
    # every weight format, both KV dtypes, Qwen2's biases, Mistral's sliding window (16
    # positions in tiny_models) with more rows than the window, and Mixtral's experts (4, top 2);
    # q4's policy mixes formats: at 6 bits a weight the llama's w2 and output are q8, the rest
    # q4 in groups of 32; at 7 bits Mixtral's expert w2 stack is q8 beside q4 w1 / w3; at 4.6
    # Qwen2's wo and w2 are q4 in groups of 64
    [
        ("llama", "fp16", "fp16", 9, 5.0),
        ("llama", "fp8", "fp8", 9, 5.0),
        ("qwen2", "gf4", "fp8", 9, 5.0),
        ("mistral", "fp16", "fp16", 21, 5.0),
        ("mixtral", "gf4", "fp16", 9, 5.0),
        ("llama", "q8", "fp16", 9, 5.0),
        ("llama", "q4", "fp16", 9, 6.0),
        ("qwen2", "q4", "fp8", 9, 4.6),
        ("mixtral", "q4", "fp16", 9, 7.0),
    ],
)
def test_prefill_logits_match_token_path(tmp_path, arch, dtype, kv, n, bits):
    model = tiny_model(tmp_path, arch, dtype, n_layers=1, bits=bits)
    ids = tokens(n)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype=kv)
    blocks = list(gpu.prefill_logits(ids, 0))
    got = np.concatenate(blocks)
    assert got.shape == (n, model.config.vocab_size)
    # the prefill's own math in NumPy (fp16 activations): float32 summation order apart (fp8:
    # attending over the engine's cache, check_kv says why)
    assert rel_l2(got, prefill_ref(model, kv, ids, over=gpu if kv == "fp8" else None)[0]) < 2e-3
    want, cpu = token_path(model, kv, ids)
    check_caches(gpu, cpu, kv, n)
    if kv == "fp8":  # over the prefill's cache (check_kv says why)
        want, _ = token_path(model, kv, ids, gpu)
    assert rel_l2(got, want) < 2e-3
    if GPU and kv == "fp16":  # the GPU's own token step too
        token = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype=kv)
        steps = np.stack([token.logits(t, pos) for pos, t in enumerate(ids)])
        assert rel_l2(got, steps) < 2e-3


def test_prefill_chunks_and_second_turn(tmp_path):
    """Chunks of 4 rows: a first turn of 5 tokens (4 + 1), then a second turn at start_pos 5
    (a chat's next turn: 4 + 3 rows over the cached 5), whose logits match the token path at
    positions 5..11; the KV cache rows of both turns match the reference's."""
    model = tiny_model(tmp_path, "llama", "fp16")
    ids = tokens(12, seed=1)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", options=EngineOptions(prefill_chunk=4))
    gpu.prefill(ids[:5], 0)
    got = np.concatenate(list(gpu.prefill_logits(ids[5:], 5)))
    assert got.shape == (7, model.config.vocab_size)
    want, cpu = token_path(model, "fp16", ids)
    assert rel_l2(got, want[5:]) < 2e-3
    check_caches(gpu, cpu, "fp16", 12)


def test_prefill_rows_do_not_depend_on_the_pass(tmp_path):
    """A row's logits are the same bits whatever other rows share a pass of the same product
    kind: rows 0..2 of a 16-row prefill (fp16's most rows on skinny's products, SKINNY_ROWS)
    against a 3-row one, and row 3 against a 1-row pass at position 3 over the cached rows
    (skinny's K order does not depend on T; the split attention's splits start at key 0 for
    every row). Speculative decoding's verification pass (up to 16 rows) needs this: the rows a
    pass scores are the ones a shorter pass would give. Longer passes take the tiled products,
    whose sums differ in order; batch-invariant engines keep skinny's for every pass
    (test_batch_invariant_tokens_do_not_depend_on_how_the_prompt_is_fed)."""
    model = tiny_model(tmp_path, "qwen2", "fp16", n_layers=1)
    ids = tokens(16, seed=5)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    full = np.concatenate(list(gpu.prefill_logits(ids, 0)))
    three = np.concatenate(list(gpu.prefill_logits(ids[:3], 0)))
    one = np.concatenate(list(gpu.prefill_logits(ids[3:4], 3)))  # rows 0..2 as the 3-row pass left them
    assert np.array_equal(full[:3], three)
    assert np.array_equal(full[3], one[0])


def test_batch_invariant_tokens_do_not_depend_on_how_the_prompt_is_fed(tmp_path):
    """EngineOptions(batch_invariant=True), every token through the multi-token forward (the
    token step is its one-row pass, never the matvec layers): the prompt in passes of up to 4
    rows, one token at a time (a pass of a row each, then generate from the last token), and
    after a call of no new tokens that cached its first part (the API's prefix reuse) give the
    same greedy tokens; with an fp8 KV cache, where the matvec step's logits differ from the
    prefill's the most. (A seeded sample draws from the same logits: the same tokens.)"""
    model = tiny_model(tmp_path, "qwen2", "fp8", n_layers=1)
    ids = tokens(6, seed=8)
    gpu = GpuEngine(
        model, seq_len=SEQ_LEN, kv_dtype="fp8", options=EngineOptions(batch_invariant=True, prefill_chunk=4)
    )
    gpu.layers_step = lambda span: pytest.fail("a batch-invariant token step ran the matvec layers")
    want = list(gpu.generate(ids, 0, 2, GREEDY))  # passes of 4 and 1 rows, then the one-row steps
    assert len(want) == 2
    for pos, token in enumerate(ids[:-1]):  # one token at a time
        gpu.prefill([token], pos)
    assert list(gpu.generate(ids[-1:], len(ids) - 1, 2, GREEDY)) == want
    assert list(gpu.generate(ids[:4], 0, 0, GREEDY)) == []  # feeds positions 0..2, as generate does
    assert list(gpu.generate(ids[3:], 3, 2, GREEDY)) == want
    # the token step's logits are the rows pass's bits: a pass of the prompt and the first
    # token, whose last two rows' logits pick what the steps picked
    rows = gpu.forward_rows([*ids, want[0]], 0)
    assert [int(np.argmax(r)) for r in rows[-2:]] == want


def test_batch_invariant_needs_the_multi_token_forward(tmp_path):
    """batch_invariant on a model the multi-token forward does not take (head_dim 8): one clear
    error naming why, before any weight is copied."""
    tiny = make_hf_llama(
        tmp_path, dim=32, hidden_dim=48, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64
    )
    model = open_model(convert(tiny.path, tmp_path / "hd8.pycalm", "fp16", progress=False))
    with pytest.raises(PycalmError, match="batch-invariant decoding .* does not take head_dim 8"):
        GpuEngine(model, seq_len=SEQ_LEN, options=EngineOptions(batch_invariant=True))


def test_mixtral_prefill_chunks_deterministic(tmp_path):
    """Mixtral (4 experts, top 2) in chunks of 4 rows (4 + 4 + 1: each chunk's rows grouped by
    expert anew), fp8 weights: logits against prefill_ref and the token path, and a second
    prefill of the same prompt gives the same logits bit for bit (each slot's sums are one
    block's and a row's slots are added in a fixed order: no atomics)."""
    model = tiny_model(tmp_path, "mixtral", "fp8", n_layers=1)
    ids = tokens(9, seed=6)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", options=EngineOptions(prefill_chunk=4))
    got = np.concatenate(list(gpu.prefill_logits(ids, 0)))
    assert rel_l2(got, prefill_ref(model, "fp16", ids)[0]) < 2e-3
    want, cpu = token_path(model, "fp16", ids)
    assert rel_l2(got, want) < 2e-3
    check_caches(gpu, cpu, "fp16", len(ids))
    again = np.concatenate(list(gpu.prefill_logits(ids, 0)))
    assert np.array_equal(got, again)


def test_generate_greedy_identical(tmp_path):
    """generate's prompt through the multi-token forward, then token steps: the same greedy
    tokens as the reference, for a first turn and a second turn after it."""
    model = tiny_model(tmp_path, "qwen2", "gf4")
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp8", options=EngineOptions(prefill_chunk=4))
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp8")
    first = tokens(6, seed=2)
    want = list(cpu.generate(first, 0, 2, GREEDY))
    got = list(gpu.generate(first, 0, 2, GREEDY))
    assert got == want and len(got) == 2
    # the second turn: the last sampled token was never fed; it goes first, then 3 more
    second = [got[-1], *tokens(3, seed=3)]
    start = len(first) + len(got) - 1
    want = list(cpu.generate(second, start, 1, GREEDY))
    got = list(gpu.generate(second, start, 1, GREEDY))
    assert got == want and len(got) == 1


def test_one_token_before_the_last_goes_by_a_token_step(tmp_path):
    """generate with two tokens (a draft model's catch-up after a pass that kept every draft):
    the first goes in by a token step, not the multi-token forward, and the tokens are the
    reference's; three tokens take the forward for the first two."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    ids = tokens(7, seed=11)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    want = list(cpu.generate(ids, 0, 2, GREEDY))
    assert list(gpu.generate(ids[:4], 0, 0, GREEDY)) == []  # positions 0..2 in the cache
    fed = []
    prefill = gpu.prefill
    gpu.prefill = lambda part, pos: (fed.append((list(part), pos)), prefill(part, pos))
    assert list(gpu.generate(ids[3:5], 3, 0, GREEDY)) == [] and fed == []  # position 3 by a step
    assert list(gpu.generate(ids[4:], 4, 2, GREEDY)) == want and fed == [(ids[4:6], 4)]


@gpu_only("graphs: the captured rows pass")
def test_short_prompt_goes_by_the_captured_rows_pass(tmp_path):
    """prefill of up to 64 tokens replays the rows pass's graph (one call of forward_rows, its
    keys and values alone): the KV cache rows are the reference's and generate after it gives
    the reference's tokens; a
    longer prompt, and Mixtral's (whose rows pass is not captured), take the multi-token
    forward."""
    model = tiny_model(tmp_path, "qwen2", "q8", n_layers=1)
    ids = tokens(70, seed=12)
    gpu = GpuEngine(model, seq_len=128, kv_dtype="fp16")
    passes = []
    rows = gpu.forward_rows
    gpu.forward_rows = lambda *a, **k: (passes.append(len(a[0])), rows(*a, **k))[1]
    gpu.prefill(ids[:9], 0)
    assert passes == [9]
    want, cpu = token_path(model, "fp16", ids[:9])
    check_caches(gpu, cpu, "fp16", 9)
    assert list(gpu.generate(ids[9:12], 9, 3, GREEDY)) == list(cpu.generate(ids[9:12], 9, 3, GREEDY))
    assert passes == [9, 2]  # generate's prompt but its last token
    gpu.prefill(ids[:66], 0)
    assert passes == [9, 2]
    moe = GpuEngine(tiny_model(tmp_path, "mixtral", "fp8", n_layers=1), seq_len=128, kv_dtype="fp16")
    moe.forward_rows = lambda *a, **k: pytest.fail(
        "Mixtral's rows pass is not captured: the forward takes it"
    )
    moe.prefill(ids[:9], 0)


def test_perplexity_matches_reference(tmp_path):
    """generate.mean_nll (the -x mode): the GPU engine's logits of every position from the
    multi-token forward, the reference's token by token; perplexities within 0.5%."""
    model = tiny_model(tmp_path, "llama", "fp8")
    ids = tokens(14, seed=4)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    got, want = np.exp(mean_nll(gpu, ids)), np.exp(mean_nll(cpu, ids))
    assert abs(got / want - 1) < 5e-3
    assert np.isfinite(want) and want > 1  # a random tiny model is often confidently wrong: no upper bound


@GPU_ONLY
@pytest.mark.parametrize(
    "arch,dtype,kv",
    [
        ("llama", "fp16", "fp16"),
        ("llama", "fp8", "fp16"),
        ("llama", "gf4", "fp16"),
        ("llama", "gf4", "fp8"),
        ("llama", "q8", "fp16"),
        ("llama", "q4", "fp8"),
        ("mixtral", "fp16", "fp16"),
        ("mixtral", "fp8", "fp8"),
        ("mixtral", "q4", "fp16"),
    ],
)
def test_prefill_realistic_shape(tmp_path, arch, dtype, kv):
    """Head_dim 128, GQA 8:1, dims of many tiles, a 240-token prompt in chunks of 96 (three,
    the last short): logits and KV cache against prefill_ref (the same math in NumPy), and
    position 0's logits against the token path.

    Not the later positions against the token path: in this random model the residual stream
    grows to 3e4 and attention scores are large, so attention turns the fp16 rounding of the
    activations (4.9e-4 an element) into a 1.2% relative L2 over all rows (8% on the worst row)
    between the fp16-activation and the float32 token path; the NumPy prefill_ref differs from
    the token path by the same 1.2% (0.012379 against the H200's 0.012381 at fp16), so that is
    the rounding's, not a kernel's. Position 0 (no attention mixing) agrees to 8e-4.

    fp8 KV: prefill_ref attends over the engine's cache, and its own cache rows, made from what
    that attention gives, are checked against the engine's (check_kv): with its own fp8 cache
    a layer's rounding flips (check_kv) reach the next layer's k and v, by more than one e5m2
    step on the H200.

    Mixtral: 8 experts of hidden_dim 2816, top 2 (about 60 rows an expert a chunk), in one layer
    (the MoE block last). A row whose top-2 choice is decided by a small router-logit gap may
    take another expert on the GPU (fp16 activations, its summation order) than in NumPy, its
    own routing; rows with a gap under 0.1 (3 of the 240 here, the smallest 0.049; the median
    gap is 5.0) are left out of the logits' comparison, and at most 5% may be. With two layers a flipped row reaches every later row through the next layer's
    attention (on the H200: 5.0e-3 relative L2 over all rows at fp16, the smallest gap 0.017)."""
    mixtral = arch == "mixtral"
    tiny = make_hf_llama(
        tmp_path, arch=arch, dim=1024, hidden_dim=2816, n_layers=1 if mixtral else 2, n_heads=8, n_kv_heads=1,
        vocab_size=4096, n_experts=8,
    )  # fmt: skip
    model = open_model(convert(tiny.path, tmp_path / f"big-{arch}-{dtype}.pycalm", dtype, progress=False))
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 4096, 240)]
    gpu = GpuEngine(model, seq_len=256, kv_dtype=kv, options=EngineOptions(prefill_chunk=96))
    got = np.concatenate(list(gpu.prefill_logits(ids, 0)))
    margins: list[np.ndarray] = []
    want, k_cache, v_cache = prefill_ref(model, kv, ids, over=gpu if kv == "fp8" else None, margins=margins)
    for layer, cache in enumerate(gpu.kv_caches):
        check_kv(decoded(cache.k, kv)[:240], k_cache[layer], kv)
        check_kv(decoded(cache.v, kv)[:240], v_cache[layer], kv)
    rows = np.min(margins, axis=0) > 0.1 if mixtral else np.ones(240, bool)
    assert rows.mean() >= 0.95
    assert rel_l2(got[rows], want[rows]) < 2e-3
    # position 0 against the GPU token step: within 2e-3, or 1.5x the distance of the NumPy
    # emulation (fp16 activations) from the float32 token path where that is larger (Mixtral
    # fp16 here: 5.6e-3 in NumPy, 6.6e-3 on the H200)
    gap = rel_l2(want[0], CpuEngine(model, seq_len=8, kv_dtype=kv).logits(ids[0], 0))
    token = GpuEngine(model, seq_len=256, kv_dtype=kv)
    assert rel_l2(got[0], token.logits(ids[0], 0)) < max(2e-3, 1.5 * gap)


def test_rows_pass(tmp_path):
    """GpuEngine.forward_rows (the rows pass: pycalm.kernels.skinny's products): its logits for 5
    tokens at position 0 and then 3 at position 5 match the multi-token forward's NumPy reference
    and the token path, and its KV cache rows the reference's; under batch_invariant a row's
    logits are the same bits in a pass of 1, 3 and 8 rows, and the same as the prompt's pass
    gave them."""
    model = tiny_model(tmp_path, "qwen2", "fp8", n_layers=1)  # biases; every matrix through skinny
    ids = tokens(8, seed=9)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    got = np.concatenate([gpu.forward_rows(ids[:5], 0), gpu.forward_rows(ids[5:], 5)])
    assert got.shape == (8, model.config.vocab_size)
    assert rel_l2(got, prefill_ref(model, "fp16", ids)[0]) < 2e-3
    want, cpu = token_path(model, "fp16", ids)
    assert rel_l2(got, want) < 2e-3
    check_caches(gpu, cpu, "fp16", 8)
    inv = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", options=EngineOptions(batch_invariant=True))
    eight = inv.forward_rows(ids, 0)
    assert np.array_equal(eight[:3], inv.forward_rows(ids[:3], 0))
    assert np.array_equal(eight[3], inv.forward_rows(ids[3:4], 3)[0])
    assert np.array_equal(eight, np.concatenate(list(inv.prefill_logits(ids, 0))))
    with pytest.raises(PycalmError, match="a rows pass takes 1 to 64 tokens"):
        gpu.forward_rows(ids, SEQ_LEN - 4)


@pytest.mark.parametrize("dtype", ["fp8", "gf4", "q8", "q4"])
def test_panel_rows_pass_folds_its_norms(tmp_path, dtype):
    """A rows pass of 33 to 64 rows in fp8, gf4, q8 or q4 takes pycalm.kernels.panel's products
    with each RMSNorm but the first folded into the residual product before it (Prefill.folds):
    its logits for 40 tokens match the multi-token forward's NumPy reference and the token path,
    and its KV cache rows the reference's (q4 at 6 bits a weight: its w2 and output are q8;
    hidden_dim 64: gf4's 32-weight loads)."""
    tiny = make_hf_llama(
        tmp_path, dim=32, hidden_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=64
    )
    model = open_model(convert(tiny.path, tmp_path / f"{dtype}.pycalm", dtype, progress=False, bits=6.0))
    ids = tokens(40, seed=13)
    gpu = GpuEngine(model, seq_len=64, kv_dtype="fp16")
    assert gpu._prefill_step().folds(40) and not gpu._prefill_step().folds(65)
    got = gpu.forward_rows(ids, 0)
    ref = prefill_ref(model, "fp16", ids)[0]
    assert rel_l2(got, ref) < 2e-3  # (unfolded: 3e-4, xb rounded at the last norm's scale apart)
    # the token path: within 1.5x the reference's own distance from it (fp16 activations against
    # float32 over 40 positions and two layers: 2.8e-3 here)
    want, cpu = token_path(model, "fp16", ids, seq_len=64)
    assert rel_l2(got, want) < max(2e-3, 1.5 * rel_l2(ref, want))
    check_caches(gpu, cpu, "fp16", 40)


@pytest.mark.parametrize("dtype", ["gf4", "q4"])
def test_rows_pass_gate_on_the_panel(tmp_path, monkeypatch, dtype):
    """In a rows pass of 17 to 32 rows, gf4's and q4's gate launch takes pycalm.kernels.panel's
    products and their other matrices skinny's (prefill.SKINNY_GATE_ROWS), the RMSNorms folded
    across the two (skinny's wo writes the FFN norm's input, the panel's gate scales its rows):
    its logits for 20 tokens match the NumPy reference and the token path, and its KV cache rows
    the reference's (q4 at 6 bits a weight: w1 and w3 in q4, w2 and the output in q8)."""
    from pycalm.kernels import panel

    launched = []

    def spy(x, w, out, dtype, **kwargs):  # noqa: ANN001, ANN003, ANN202
        launched.append((kwargs.get("mode", "plain"), x.shape[0]))
        return panel_matmul(x, w, out, dtype, **kwargs)

    panel_matmul = panel.panel_matmul
    monkeypatch.setattr(panel, "panel_matmul", spy)
    tiny = make_hf_llama(
        tmp_path, dim=32, hidden_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=64
    )
    model = open_model(convert(tiny.path, tmp_path / f"{dtype}.pycalm", dtype, progress=False, bits=6.0))
    ids = tokens(20, seed=17)
    gpu = GpuEngine(model, seq_len=64, kv_dtype="fp16")
    assert gpu._prefill_step().folds(20)
    got = gpu.forward_rows(ids, 0)
    assert len(launched) >= 2 and {mode for mode, _ in launched} == {"gate"}  # the gate alone, a layer
    assert all(20 <= rows <= 32 for _, rows in launched)  # the pass's rows (on a GPU its bucket's)
    ref = prefill_ref(model, "fp16", ids)[0]
    assert rel_l2(got, ref) < 2e-3
    want, cpu = token_path(model, "fp16", ids, seq_len=64)
    assert rel_l2(got, want) < max(2e-3, 1.5 * rel_l2(ref, want))
    check_caches(gpu, cpu, "fp16", 20)


def test_rows_pass_attention_covers_its_span(tmp_path):
    """A rows pass's split attention covers the span of its last row's position (as the token
    step's), a captured pass a (bucket, span): its logits match the reference in a pass whose
    rows reach past the first span; under batch_invariant the splits are fixed for the cache, so
    a row gives the same bits in a pass within the first span and in one reaching past it."""
    from pycalm.kernels.attention import attention_span

    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    ids = tokens(20, seed=3)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    chunk = gpu.att_scratch.chunk
    spans = (gpu._prefill_step().span_of(12, 4), gpu._prefill_step().span_of(12, 8))
    assert spans == (attention_span(15, chunk, SEQ_LEN), attention_span(19, chunk, SEQ_LEN))
    got = np.concatenate([gpu.forward_rows(ids[:12], 0), gpu.forward_rows(ids[12:], 12)])
    assert rel_l2(got, prefill_ref(model, "fp16", ids)[0]) < 2e-3
    inv = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", options=EngineOptions(batch_invariant=True))
    inv.forward_rows(ids[:12], 0)
    wide = inv.forward_rows(ids[12:], 12)  # rows 12..19
    assert np.array_equal(wide[:4], inv.forward_rows(ids[12:16], 12))  # rows 12..15
    assert np.array_equal(wide[4:], inv.forward_rows(ids[16:], 16))


@gpu_only("graphs: the captured rows passes")
def test_prepare_captures_the_rows_passes_of_every_span(tmp_path):
    """prepare(rows=...): a sampled and a keys-and-values-only pass of each bucket at each span
    the positions reach are captured before any call; a pass then captures nothing new and
    gives the same tokens as an engine that captured it on the spot."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    seq_len = 256
    ready, cold = (GpuEngine(model, seq_len=seq_len, kv_dtype="fp16") for _ in range(2))
    ready.prepare(GREEDY, range(seq_len), rows=(2, 3))
    graphs = ready._prefill_step()._rows_graphs
    spans = {ready._prefill_step().span_of(p, n) for n in (2, 4) for p in range(seq_len - n + 1)}
    want = {(n, gives, ready._prefill_step().span_of(p, n)) for n in (2, 4) for gives in ("tokens", "cache")
            for p in range(seq_len - n + 1)}  # fmt: skip
    assert len(spans) > 1 and set(graphs) == want
    ids = tokens(40, seed=2)
    for e in (ready, cold):
        e.prefill(ids[:37], 0)
    got = ready.forward_rows(ids[37:], 37, [GREEDY] * 3, np.zeros(3))
    assert {key for key in graphs if key[0] in (2, 4)} == want  # (the prompt's pass: bucket 64)
    assert np.array_equal(got, cold.forward_rows(ids[37:], 37, [GREEDY] * 3, np.zeros(3)))


def test_draft_tokens_go_into_the_rows_pass_on_the_device(tmp_path):
    """greedy_tokens: generate's greedy tokens, left on the device (and in their pinned copy once
    the event has passed); a rows pass with them as its tail gives the logits of a pass given the
    same ids on the host, and writes the same cache rows."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    ids = tokens(2, seed=12)
    draft, plain, target, host = (GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16") for _ in range(4))
    want = list(plain.generate(ids, 0, 2, SamplingParams(ignore_eos=True)))  # (no EOS stops greedy_tokens)
    drafted = draft.greedy_tokens(ids, 0, 2)
    got = target.forward_rows(ids, 0, tail=drafted)  # (4, vocab_size)
    assert list(drafted.host) == want  # (its event passed before the pass began)
    assert np.array_equal(got, host.forward_rows([*ids, *want], 0))
    for a, b in zip(target.kv_caches, host.kv_caches, strict=True):
        assert np.array_equal(a.k.copy_to_host()[:4], b.k.copy_to_host()[:4])
        assert np.array_equal(a.v.copy_to_host()[:4], b.v.copy_to_host()[:4])
    with pytest.raises(PycalmError, match="greedy_tokens feeds"):
        draft.greedy_tokens(ids[:1], SEQ_LEN - 2, 4)


def test_cache_only_rows_pass_writes_the_same_keys_and_values(tmp_path):
    """forward_rows(cache_only=True) (GpuEngine.prefill's pass of a short prompt): the keys and
    values of a pass that computes logits, bit for bit, and nothing back."""
    model = tiny_model(tmp_path, "qwen2", "q8", n_layers=1)
    ids = tokens(3, seed=5)
    fed, full = (GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16") for _ in range(2))
    assert fed.forward_rows(ids, 2, cache_only=True) is None
    full.forward_rows(ids, 2)
    for a, b in zip(fed.kv_caches, full.kv_caches, strict=True):
        assert np.array_equal(a.k.copy_to_host()[2:5], b.k.copy_to_host()[2:5])
        assert np.array_equal(a.v.copy_to_host()[2:5], b.v.copy_to_host()[2:5])
        assert np.any(a.k.copy_to_host()[2:5] != 0)


def test_draft_tokens_feed_their_last_after_the_event(tmp_path):
    """greedy_tokens(feed_last=True): the same tokens, and one more step caches the last one's
    keys and values, as generate's step that feeds it does; at the end of the context there is
    no room for it (fed_last False)."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    ids = tokens(2, seed=12)
    draft, plain = (GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16") for _ in range(2))
    want = list(plain.generate(ids, 0, 3, SamplingParams(ignore_eos=True)))  # rows 0..3 fed
    drafted = draft.greedy_tokens(ids, 0, 2, feed_last=True)
    drafted.event.synchronize()
    assert drafted.fed_last and list(drafted.host) == want[:2]
    draft.stream.synchronize()
    for a, b in zip(draft.kv_caches, plain.kv_caches, strict=True):
        assert np.array_equal(a.k.copy_to_host()[:4], b.k.copy_to_host()[:4])
        assert np.array_equal(a.v.copy_to_host()[:4], b.v.copy_to_host()[:4])
    assert not draft.greedy_tokens(ids[:1], SEQ_LEN - 2, 2, feed_last=True).fed_last


def test_rows_pass_samples_every_row(tmp_path):
    """forward_rows with a SamplingParams and a coin a row: each row's token is sample_ref's over
    that row's logits (the same pass's, read back), greedy rows and sampled ones in one pass."""
    from pycalm.cpu.reference import sample_ref

    model = tiny_model(tmp_path, "llama", "fp8", n_layers=1)
    ids = tokens(5, seed=10)
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    logits = gpu.forward_rows(ids, 0)
    settings = [GREEDY, SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.0, top_p=0.9),
                GREEDY, SamplingParams(temperature=1.3, min_p=0.05)]  # fmt: skip
    coins = np.array([0.5, 0.31, 0.77, 0.2, 0.05], np.float32)
    got = gpu.forward_rows(ids, 0, settings, coins)
    want = [
        sample_ref(row, s.temperature, s.top_k, s.top_p, s.min_p, c)
        for row, s, c in zip(logits, settings, coins, strict=True)
    ]
    assert list(got) == want
