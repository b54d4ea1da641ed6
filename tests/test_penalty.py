"""Penalties and logit bias: the kernel (pycalm.kernels.penalty) against penalties_ref, the host
Sampler's rule, the GPU engine against the CPU engine with penalties, and the checks' messages."""

from __future__ import annotations

import numpy as np
import pytest
from gpu import GPU, gpu_only

from pycalm.cpu.reference import penalties_ref, prompt_flags
from pycalm.cpu.sampler import Penalties, Sampler, SamplingParams
from pycalm.errors import PycalmError
from pycalm.kernels.common import STATE_FEED_END, STATE_POS, STATE_SIZE, STATE_TOKEN

PENALTIES = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.3)


def run_kernel(logits, counts, prompt, sampling, token, pos, feed_end):
    """One launch of penalize on device copies; returns (out, counts after)."""
    from numba import cuda

    from pycalm.kernels.penalty import PenaltyBuffers, penalize

    s = cuda.stream()
    b = PenaltyBuffers.allocate(len(logits), s)
    b.reset(sampling, prompt, s)
    b.counts.copy_to_device(counts, stream=s)
    state = np.zeros(STATE_SIZE, np.int32)
    state[STATE_TOKEN], state[STATE_POS], state[STATE_FEED_END] = token, pos, feed_end
    out = penalize(cuda.to_device(logits, stream=s), cuda.to_device(state, stream=s), b, stream=s)
    s.synchronize()
    return out.copy_to_host(), b.counts.copy_to_host()


@pytest.mark.parametrize("vocab", [37, 301, 1029] if not GPU else [151_936, 128_257, 49_153])
def test_kernel_matches_reference(vocab):
    """Random logits of both signs (zeros too) at odd vocabulary sizes (37: fewer than a block),
    tokens generated 0 to 3 times, a prompt, a bias on a few tokens: the kernel's logits are the
    reference's (float32 in the same order: equal under the simulator; on the GPU a fused
    multiply-add leaves frequency * n unrounded), and it counts the step's input token only past
    the prompt."""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 4).astype(np.float32)
    logits[rng.choice(vocab, 5, replace=False)] = 0.0
    counts = rng.integers(0, 4, vocab).astype(np.int32) * (rng.random(vocab) < 0.3)
    counts = counts.astype(np.int32)
    prompt = [int(t) for t in rng.choice(vocab, min(vocab // 3, 40), replace=False)]
    bias = tuple(
        (int(t), float(v))
        for t, v in zip(rng.choice(vocab, 6, replace=False), [100, -100, 2.5, -0.5, 0, 7], strict=True)
    )
    sampling = SamplingParams(
        presence_penalty=0.7, frequency_penalty=-0.4, repetition_penalty=1.3, logit_bias=bias
    )
    dense = np.zeros(vocab, np.float32)
    for t, v in bias:
        dense[t] = v
    token = int(rng.integers(vocab))
    for pos, feed_end, counted in ((9, 10, False), (10, 10, True)):  # the prompt's last token; a sampled one
        want_counts = counts.copy()
        want_counts[token] += counted
        want = penalties_ref(logits, want_counts, prompt_flags(prompt, vocab), 0.7, -0.4, 1.3, dense)
        out, after = run_kernel(logits, counts, prompt, sampling, token, pos, feed_end)
        np.testing.assert_array_equal(after, want_counts)
        if GPU:  # a fused multiply-add: frequency * n unrounded (2^-24 |f n| < 1e-6), then 1 ulp
            np.testing.assert_allclose(out, want, rtol=2**-22, atol=1e-6)
        else:  # the simulator: NumPy's float32 in the reference's order
            np.testing.assert_array_equal(out, want)


def test_reference_rule():
    """penalties_ref on a hand-made case: a seen positive logit divided by r, a negative one
    multiplied; presence and frequency on generated tokens only; the bias added last."""
    logits = np.array([2.0, -2.0, 2.0, 1.0, 1.0], np.float32)
    counts = np.array([0, 2, 1, 0, 0], np.int32)
    prompt = prompt_flags([0], 5)
    bias = np.array([0, 0, 0, 0, -100], np.float32)
    got = penalties_ref(logits, counts, prompt, 0.5, 0.25, 2.0, bias)
    np.testing.assert_array_equal(got, [1.0, -4.0 - 0.5 - 0.5, 1.0 - 0.25 - 0.5, 1.0, -99.0])


def test_sampler_counts_and_checks():
    """The host Sampler penalises what it drew: greedy on flat logits with a frequency penalty
    walks through the tokens in order (each drawn token drops below the rest); bad options are a
    one-line PycalmError."""
    s = SamplingParams(frequency_penalty=1.0)
    sampler = Sampler.for_request(s, [0], 4)
    assert [sampler.sample(np.zeros(4, np.float32)) for _ in range(5)] == [0, 1, 2, 3, 0]
    # a +100 bias forces a token; -100 bans the greedy one
    logits = np.array([3.0, 1.0, 2.0], np.float32)
    assert Sampler.for_request(SamplingParams(logit_bias=((1, 100.0),)), [], 3).sample(logits) == 1
    assert Sampler.for_request(SamplingParams(logit_bias=((0, -100.0),)), [], 3).sample(logits) == 2
    for bad, match in (
        (SamplingParams(presence_penalty=2.5), "presence_penalty must be from -2 to 2"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be"),
        (SamplingParams(logit_bias=((7, 1.0),)), "token id 7 is outside the vocabulary"),
        (SamplingParams(logit_bias=((1, 101.0),)), "must be from -100 to 100"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "at most 300"),
    ):
        with pytest.raises(PycalmError, match=match):
            Penalties(bad, [], 4)
    assert not SamplingParams().penalized and PENALTIES.penalized
    assert SamplingParams(logit_bias=((1, 0.0),)).penalized


@pytest.mark.parametrize(
    "path",
    [
        "fast",
        pytest.param("simple", marks=gpu_only("simulator time")),
        pytest.param("batch_invariant", marks=gpu_only("simulator time")),
    ],
)
def test_engine_penalties_match_cpu(tmp_path, path):
    """GpuEngine.generate with penalties and a bias against the CPU engine: the same greedy
    tokens, on the token step with the penalty kernel ("fast"), and on the GPU the paths that draw
    on the host (the simple kernels, batch-invariant decoding); then the prompt fed in two calls
    (its first tokens cached, given as the prefix that repetition still counts): its first token
    already depends on the counts being reset and the prefix's flags set."""
    from test_prefill import SEQ_LEN, tiny_model, tokens

    from pycalm.cpu.engine import CpuEngine
    from pycalm.gpu.engine import EngineOptions, GpuEngine

    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    prompt = tokens(5, seed=3)
    # a strong repetition penalty over a prompt that a tiny model would echo, and a bias
    sampling = SamplingParams(
        presence_penalty=1.5,
        frequency_penalty=0.5,
        repetition_penalty=3.0,
        logit_bias=((5, 2.0), (9, -100.0)),
    )
    n = 3 if not GPU else 12  # under the simulator a token step takes seconds
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16")
    want = list(cpu.generate(prompt, 0, n, sampling))
    assert want != list(cpu.generate(prompt, 0, n, SamplingParams())) and 9 not in want
    options = EngineOptions(
        decode_lookahead=2,
        kernels="simple" if path == "simple" else "fast",
        batch_invariant=path == "batch_invariant",
    )
    gpu = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype="fp16", options=options)
    assert list(gpu.generate(prompt, 0, n, sampling)) == want
    gpu.prefill(prompt[:3], 0)
    assert list(gpu.generate(prompt[3:], 3, 2, sampling, prefix=prompt[:3])) == want[:2]
