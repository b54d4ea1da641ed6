"""What a user waits for: the weights' upload, and generate's decode loop with steps enqueued ahead.

Under the CUDA simulator the decode loop is tested with a stand-in token step (the engine's
forward replaced by a few NumPy lines that read and write the same device state), so a run
of dozens of steps across every attention span takes a second; the kernels' own step is what
tests/test_model.py checks against the reference. The stand-in samples a token that depends on
the token and position it is given, so any step run out of order, twice or at the wrong
position changes the tokens. With PYCALM_TEST_GPU=1 a second test runs the real step.
"""

import dataclasses

import numpy as np
import pytest
from gpu import gpu_only
from tiny_models import make_hf_llama

from pycalm.convert.main import convert
from pycalm.cpu.sampler import SamplingParams
from pycalm.gpu.engine import EngineOptions, GpuEngine
from pycalm.kernels.common import STATE_FEED_END, STATE_POS, STATE_TOKEN
from pycalm.model import loader
from pycalm.model.loader import open_model, upload_tensors

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("startup")
    src = make_hf_llama(tmp, dim=32, hidden_dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64)
    return open_model(convert(src.path, tmp / "tiny.pycalm", "fp8", progress=False))


# ---------------------------------------------------------------------------------------------
# the upload


def test_upload_tensors_matches_the_file(tiny, monkeypatch):
    from numba import cuda

    # pieces of 40 bytes through 3 buffers: tensors split across pieces, buffers reused many times
    monkeypatch.setattr(loader, "STAGING_BYTES", 40)
    monkeypatch.setattr(loader, "STAGING_BUFFERS", 3)
    names = [n for n in tiny.names() if n != "tokenizer"]
    got = upload_tensors(tiny, names, stream=cuda.stream())
    assert sorted(got) == sorted(names)
    for name in names:
        want = tiny.tensor(name)
        out = got[name].copy_to_host()
        assert out.dtype == want.dtype and out.shape == want.shape, name
        np.testing.assert_array_equal(out, want, err_msg=name)


# ---------------------------------------------------------------------------------------------
# the decode loop, with a stand-in step


def fake_token(token: int, pos: int, vocab: int) -> int:
    return (token * 7 + pos * 3 + 1) % vocab


def engine_with_fake_step(model, lookahead: int, seq_len: int = 40, eos: tuple[int, ...] = ()) -> GpuEngine:
    """A GpuEngine whose token step is a NumPy stand-in: sample = fake_token(token, pos), then
    advance as pycalm.kernels.step does. Each step also checks that its graph's span covers its
    position and records (pos, token) in engine.trace; its 'KV row' is engine.rows[pos]. Plain
    launches, no graphs, also on a GPU: the stand-in reads the state back on the host."""
    engine = GpuEngine(
        model,
        seq_len=seq_len,
        options=EngineOptions(use_graph=False, attention_chunk=2, decode_lookahead=lookahead),
    )
    engine.config = dataclasses.replace(engine.config, eos_ids=eos)
    engine.trace = []
    engine.rows = np.full(seq_len, -1)
    vocab = engine.config.vocab_size

    def forward(
        sampling: SamplingParams, span: int | None = None, logprobs: bool = False, penalties: bool = False
    ) -> None:
        state = engine.state.copy_to_host()
        feed = engine.feed.copy_to_host()
        token, pos = int(state[STATE_TOKEN]), int(state[STATE_POS])
        assert pos < span, (pos, span)
        engine.trace.append((pos, token))
        engine.rows[pos] = token
        nxt = pos + 1
        state[STATE_TOKEN] = feed[nxt] if nxt < state[STATE_FEED_END] else fake_token(token, pos, vocab)
        state[STATE_POS] = nxt
        engine.state.copy_to_device(state)

    def prefill(ids: list[int], start_pos: int) -> None:  # the multi-token forward: rows only
        for i, token in enumerate(ids):
            engine.rows[start_pos + i] = token

    engine.forward = forward
    engine.prefill = prefill
    return engine


def expected(ids: list[int], start_pos: int, max_new: int, vocab: int, seq_len: int, eos=()) -> list[int]:
    out, token, pos = [], ids[-1], start_pos + len(ids) - 1
    while len(out) < max_new and pos < seq_len:
        token = fake_token(token, pos, vocab)
        out.append(token)
        pos += 1
        if token in eos:
            break
    return out


def test_lookahead_gives_the_round_trip_tokens_across_every_span(tiny):
    vocab = tiny.config.vocab_size
    ids = [3, 17, 5]
    # 36 new tokens from position 2: the steps cross the spans of 4, 8, 16, 32 and 40 positions
    want = expected(ids, 0, 36, vocab, 40)
    runs = {}
    for lookahead in (1, 2, 4, 7):
        engine = engine_with_fake_step(tiny, lookahead)
        runs[lookahead] = (list(engine.generate(ids, 0, 36, GREEDY)), engine.state.copy_to_host())
        assert runs[lookahead][0] == want
        # every sampling step ran once, in order, at its own position
        assert [p for p, _ in engine.trace if p >= len(ids) - 1] == list(range(len(ids) - 1, 38))
    for _, state in runs.values():
        np.testing.assert_array_equal(state, runs[1][1])


def test_lookahead_stops_at_eos_and_leaves_the_state_of_the_round_trip(tiny):
    vocab = tiny.config.vocab_size
    ids = [3, 17, 5]
    free = expected(ids, 0, 30, vocab, 40)
    eos = (free[9],)  # the 10th token is the EOS
    want = expected(ids, 0, 30, vocab, 40, eos)
    assert len(want) == 10
    after = {}
    for lookahead in (1, 4):
        engine = engine_with_fake_step(tiny, lookahead, eos=eos)
        got = list(engine.generate(ids, 0, 30, GREEDY))
        assert got == want
        state = engine.state.copy_to_host()
        # as the round-trip loop leaves it: the EOS sampled, the next position, the prompt's end
        assert (state[STATE_TOKEN], state[STATE_POS], state[STATE_FEED_END]) == (eos[0], 12, 3)
        # the KV rows the next turn relies on (positions 0 .. 11) are the same; later ones are
        # the steps run ahead, rewritten before any step reads them
        after[lookahead] = engine.rows[:12].copy()
        # the chat's next turn: the conversation so far minus the EOS, then a new token
        cached = ids + got[:-1]
        nxt = list(engine.generate([eos[0], 9], len(cached), 5, GREEDY))
        assert nxt == expected([eos[0], 9], len(cached), 5, vocab, 40, eos)
    np.testing.assert_array_equal(after[1], after[4])


def test_a_caller_that_stops_early_leaves_the_state_of_its_last_token(tiny):
    vocab = tiny.config.vocab_size
    engine = engine_with_fake_step(tiny, 4)
    gen = engine.generate([3], 0, 20, GREEDY)
    got = [next(gen) for _ in range(5)]
    gen.close()  # steps 6.. were enqueued; the state goes back to what step 5 left
    assert got == expected([3], 0, 5, vocab, 40)
    state = engine.state.copy_to_host()
    assert (state[STATE_TOKEN], state[STATE_POS]) == (got[-1], 5)


def test_prepare_captures_one_step_a_span(tiny):
    engine = engine_with_fake_step(tiny, 4)
    engine.prepare(GREEDY, range(2, 38))
    # chunks of 2: the positions 2 .. 37 fall in the spans 4, 8, 16, 32 and 40
    assert sorted(span for _, span in engine._graphs) == [4, 8, 16, 32, 40]
    assert engine.trace == []  # the simulator's eager steps run nothing until launched


@gpu_only("simulator time")
def test_real_step_lookahead_matches_round_trip_over_a_long_run(tiny):
    """The real token step (graphs on the GPU), 150 tokens across four attention spans: the same
    tokens, and the same state after, with a round trip a token and with steps enqueued ahead."""
    runs = []
    for lookahead in (1, 4):
        engine = GpuEngine(
            tiny, seq_len=160, options=EngineOptions(attention_chunk=16, decode_lookahead=lookahead)
        )
        engine.config = dataclasses.replace(engine.config, eos_ids=())
        # a one-token prompt: every position is a token step (no multi-token prefill)
        tokens = list(engine.generate([1], 0, 150, SamplingParams(temperature=0.8, seed=5)))
        runs.append((tokens, engine.state.copy_to_host()))
    assert len(runs[0][0]) == 150
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
