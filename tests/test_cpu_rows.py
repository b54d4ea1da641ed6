"""The CPU engine's multi-token forward (ReferenceEngine.forward_rows, CpuEngine.prefill and
prefill_logits: prompts, chat turns and -x through matrix products, in chunks) against its token
step, and its BLAS thread control (--threads, pycalm.load(threads=)).

The rows path keeps its activations float32, as the token step does, so the two differ only in
the order of float32 sums: with a float32 KV cache the logits agree to 1e-5 of their largest
value (3.4e-6 measured). An fp16 cache rounds the keys and values, and a difference in the last
float32 bit can round a value to the neighbouring fp16 number, a step of 2^-11 of it: the
logits agree to 2^-10 of their largest value (1.3e-4 measured).

Tiny random models (tests/tiny_models.py): Llama (grouped-query heads), Qwen2 (QKV bias),
Mistral (a sliding window of 16, shorter than the prompts here), Mixtral (4 experts, top 2).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info
from tiny_models import make_gguf, make_hf_llama

import pycalm
from pycalm.app.perplexity import mean_nll, windows
from pycalm.convert.main import convert
from pycalm.cpu.engine import DEFAULT_THREADS, CpuEngine, check_threads
from pycalm.cpu.reference import attention_ref, prefill_attention_ref
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.model.loader import open_model

REPO = Path(__file__).resolve().parent.parent
ARCHS = ("llama", "qwen2", "mistral", "mixtral")
N_TOKENS = 37  # a prompt of odd length: chunks of 5 end in a ragged one of 2
TOLERANCE = {"fp32": 1e-5, "fp16": 2.0**-10}  # of the largest |logit| (the module docstring says why)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("rows")
    out = {}
    for arch in ARCHS:
        hf = make_hf_llama(tmp, arch=arch)
        out[arch] = open_model(convert(hf.path, tmp / f"{arch}.pycalm", "fp16", progress=False))
    return out


def prompt(seed: int = 1, n: int = N_TOKENS) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 64, n)]


def token_logits(engine: CpuEngine, ids: list[int], start_pos: int = 0) -> np.ndarray:
    """(len(ids), vocab_size): the token step's logits, one position at a time."""
    return np.stack([engine.logits(t, start_pos + i) for i, t in enumerate(ids)])


def assert_close(got: np.ndarray, want: np.ndarray, kv: str) -> None:
    assert got.shape == want.shape
    assert np.isfinite(want).all() and np.abs(want).max() > 1.0  # logits of a real spread
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= TOLERANCE[kv], err
    assert (got.argmax(axis=1) == want.argmax(axis=1)).all()  # the same greedy token each row


# ---------------------------------------------------------------------------------------------
# the rows path against the token step


@pytest.mark.parametrize("kv", ["fp32", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "chunk,sizes",  # a row a pass; chunks of 5 rows at most, within one of each other; one pass
    [(1, [1] * N_TOKENS), (5, [5, 5, 5, 5, 5, 4, 4, 4]), (64, [N_TOKENS])],
)
def test_rows_give_the_token_steps_logits(models, arch, kv, chunk, sizes):
    model, ids = models[arch], prompt()
    want_engine = CpuEngine(model, seq_len=64, kv_dtype=kv)
    want = token_logits(want_engine, ids)
    rows = CpuEngine(model, seq_len=64, kv_dtype=kv, prefill_chunk=chunk)
    blocks = list(rows.prefill_logits(ids, 0))
    assert [len(b) for b in blocks] == sizes
    assert_close(np.concatenate(blocks), want, kv)
    # the KV cache rows the two paths wrote (fp16: at most a rounding step apart)
    for name in ("key_cache", "value_cache"):
        got_c, want_c = getattr(rows.ref, name), getattr(want_engine.ref, name)[:, :N_TOKENS]
        step = np.spacing(np.abs(want_c).astype(np.float16)).astype(np.float32) if kv == "fp16" else 0
        assert (np.abs(got_c[:, :N_TOKENS] - want_c) <= step + 1e-5 * np.abs(want_c).max()).all()
        assert not got_c[:, N_TOKENS:].any()  # nothing written past the prompt


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_a_chat_turn_goes_on_from_the_cache(models, arch):
    """A second turn: 11 positions fed by token steps, the next 26 through the rows (chunks of
    4 from position 11, across Mistral's window of 16), then a token step after them."""
    model, ids, kv = models[arch], prompt(seed=2), "fp32"
    want_engine = CpuEngine(model, seq_len=64, kv_dtype=kv)
    want = token_logits(want_engine, ids + [5])
    rows = CpuEngine(model, seq_len=64, kv_dtype=kv, prefill_chunk=4)
    first = token_logits(rows, ids[:11])
    later = np.concatenate(list(rows.prefill_logits(ids[11:], 11)))
    after = rows.logits(5, N_TOKENS)[None]
    assert_close(np.concatenate([first, later, after]), want, kv)


def test_prefill_checks_the_context(models):
    engine = CpuEngine(models["llama"], seq_len=16)
    with pytest.raises(PycalmError, match="prompt of 10 tokens at position 8 does not fit the context of 16"):
        engine.prefill(prompt(n=10), 8)
    with pytest.raises(PycalmError, match="nothing to feed"):
        list(engine.prefill_logits([], 0))
    with pytest.raises(PycalmError, match=r"token id 64 outside the vocabulary \(0..63\)"):
        engine.prefill([1, 64, 2], 0)
    with pytest.raises(PycalmError, match="a prefill chunk takes at least one row, got 0"):
        CpuEngine(models["llama"], seq_len=16, prefill_chunk=0)


# ---------------------------------------------------------------------------------------------
# what feeds through the rows: generate's prompt, -x


class Counting:
    """Counts the reference engine's token steps and passes of rows."""

    def __init__(self, engine: CpuEngine) -> None:
        self.steps, self.passes = 0, []
        forward, forward_rows = engine.ref.forward, engine.ref.forward_rows

        def step(token: int, pos: int) -> np.ndarray:
            self.steps += 1
            return forward(token, pos)

        def rows(tokens: np.ndarray, pos0: int) -> np.ndarray:
            self.passes.append((pos0, len(tokens)))
            return forward_rows(tokens, pos0)

        engine.ref.forward, engine.ref.forward_rows = step, rows


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])
def test_generate_feeds_the_prompt_through_the_rows(models, arch):
    """The prompt but its last token goes through passes of rows (36 rows in chunks of 8 at
    most: 8, 7, 7, 7, 7), then token steps decode; the greedy tokens are those of the token
    steps alone (batch_invariant: the prompt a token step a token)."""
    model, ids, greedy = models[arch], prompt(seed=3), SamplingParams(temperature=0.0)
    tokens = {}
    for batch_invariant in (False, True):
        engine = CpuEngine(model, seq_len=64, prefill_chunk=8, batch_invariant=batch_invariant)
        count = Counting(engine)
        tokens[batch_invariant] = list(engine.generate(ids, 0, 6, greedy))
        fed = 0 if batch_invariant else N_TOKENS - 1
        assert count.passes == ([] if batch_invariant else [(0, 8), (8, 7), (15, 7), (22, 7), (29, 7)])
        assert count.steps == N_TOKENS - 1 - fed + len(tokens[batch_invariant])
    assert tokens[False] == tokens[True] and tokens[False]


def test_perplexity_through_the_rows(models):
    """mean_nll (the CLI's -x) in windows of 16 over 45 tokens: each window in chunks of rows,
    against the same windows scored by token steps."""

    class TokenSteps:  # the CPU engine's token step behind the prefill_logits interface
        def __init__(self, engine: CpuEngine) -> None:
            self.engine, self.seq_len = engine, engine.seq_len

        def prefill_logits(self, ids: list[int], start_pos: int):
            yield token_logits(self.engine, ids, start_pos)

    model, ids = models["mistral"], prompt(seed=4, n=45)
    assert len(windows(len(ids), 16)) == 5
    want = mean_nll(TokenSteps(CpuEngine(model, seq_len=16, kv_dtype="fp32")), ids)
    got = mean_nll(CpuEngine(model, seq_len=16, kv_dtype="fp32", prefill_chunk=6), ids)
    assert 1.0 < want < 10.0 and abs(got - want) <= 1e-6 * want


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,n_rows,pos0,window",
    [
        (2, 2, 1, 0, 0),
        (3, 1, 7, 7, 0),
        (4, 2, 11, 20, 0),
        (7, 1, 3, 14, 0),
        (2, 1, 13, 10, 6),
        (4, 4, 9, 0, 40),
    ],
)
def test_prefill_attention_ref_is_attention_ref_row_by_row(n_heads, n_kv_heads, n_rows, pos0, window):
    rng = np.random.default_rng(n_rows + pos0)
    head_dim = 16
    q = rng.standard_normal((n_rows, n_heads * head_dim)).astype(np.float32)
    k, v = rng.uniform(-2, 2, (2, pos0 + n_rows + 3, n_kv_heads * head_dim)).astype(np.float32)
    k[pos0 + n_rows :] = v[pos0 + n_rows :] = np.nan  # positions no row may read
    got = prefill_attention_ref(q, k, v, pos0, n_heads, n_kv_heads, head_dim, window)
    want = [
        attention_ref(q[t], k, v, pos0 + t + 1, n_heads, n_kv_heads, head_dim, window) for t in range(n_rows)
    ]
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# BLAS threads


def blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


@pytest.mark.parametrize("threads", [None, 1, 2])
def test_engine_runs_blas_at_its_thread_count(models, threads):
    """Each step runs BLAS at the engine's count (None: DEFAULT_THREADS, one), and the process's
    own setting is back between steps."""
    engine = CpuEngine(models["llama"], seq_len=16, threads=threads)
    before = blas_threads()
    seen = []
    forward, forward_rows = engine.ref.forward, engine.ref.forward_rows
    engine.ref.forward = lambda *a: (seen.append(blas_threads()), forward(*a))[1]
    engine.ref.forward_rows = lambda *a: (seen.append(blas_threads()), forward_rows(*a))[1]
    list(engine.generate(prompt(n=5), 0, 2, SamplingParams(temperature=0.0)))
    want = threads or DEFAULT_THREADS
    assert before and seen == [[want] * len(before)] * 3  # a pass of 4 rows, two token steps
    assert blas_threads() == before


def test_bad_thread_counts_are_one_line_errors(models):
    assert check_threads(None) == DEFAULT_THREADS == 1 and check_threads(3) == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(PycalmError, match=rf"^threads must be a whole number, 1 or more, not {bad!r}$"):
            CpuEngine(models["llama"], seq_len=16, threads=bad)
    with pytest.raises(PycalmError, match="^threads must be a whole number, 1 or more, not 0$"):
        pycalm.load("no/such/model", device="cpu", threads=0)  # checked before the model is opened


@pytest.mark.parametrize("module", ["pycalm.app.generate", "pycalm.app.serve"])
def test_threads_flag(module, capsys):
    parse_args = importlib.import_module(module).parse_args
    assert parse_args(["--threads", "2"]).threads == 2
    assert parse_args([]).threads is None
    for value, message in (
        ("0", "error: --threads 0: must be 1 or more"),
        ("-1", "error: --threads -1: must be 1 or more"),
        ("two", "error: argument --threads: invalid int value: 'two'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--threads", value])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(message + " (see python -m pycalm."), err


def test_cli_threads_give_the_same_text(tmp_path):
    """`--threads 2` runs (a real process, as a user runs it) and gives the text of one thread."""
    src = make_gguf(tmp_path, arch="llama", qtype="F16")
    model = convert(src.path, tmp_path / "tiny.pycalm", "fp16", progress=False)
    out = []
    for threads in ("1", "2"):
        args = [model, "-i", "the cat sat", "-n", "5", "-t", "0", "--device", "cpu", "--threads", threads]
        proc = subprocess.run(
            [sys.executable, "-m", "pycalm.generate", *map(str, args)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        out.append(proc.stdout)
    assert out[0] == out[1] and out[0].strip()
