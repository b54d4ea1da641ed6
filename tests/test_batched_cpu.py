"""The CPU engine's batched forward (pycalm.cpu.batched.BatchedCpuEngine) against its token step:
a few sequences of a tiny random model, driven by the continuous-batching scheduler (blocks of 4
positions, a token budget of 7 rows: prompts split into chunks, decode rows and prompt chunks of
other sequences in one pass, two prompts sharing a prefix that the prefix cache supplies), each
sequence's logits at every sampled row against CpuEngine's token steps over that sequence alone.

Tolerance: the rows path sums in another order than the token step's matrix-vector products, so
the logits agree to test_cpu_rows's bounds (1e-5 of the largest |logit| with a float32 KV cache,
2^-10 with fp16, whose rounding can turn a last-bit difference into a step of the fp16 grid).
batch_invariant runs each row through the token step's functions: the logits are equal, bit for
bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cpu_rows import ARCHS, TOLERANCE, token_logits
from tiny_models import make_hf_llama

from pycalm.batch.blocks import BlockManager
from pycalm.batch.scheduler import Request, Scheduler
from pycalm.convert.main import convert
from pycalm.cpu.batched import BatchedCpuEngine
from pycalm.cpu.engine import CpuEngine
from pycalm.model.loader import open_model

SEQ_LEN = 64
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("batched")
    out = {}
    for arch in ARCHS:
        hf = make_hf_llama(tmp, arch=arch)
        out[arch] = open_model(convert(hf.path, tmp / f"{arch}.pycalm", "fp16", progress=False))
    return out


def prompts() -> list[list[int]]:
    """Five prompts of odd lengths; the third starts with the first's 13 tokens (three full blocks
    to reuse), the last is one token."""
    rng = np.random.default_rng(5)
    p = [[int(t) for t in rng.integers(3, 64, n)] for n in (19, 6, 11, 23)]
    return [p[0], p[1], p[0][:13] + p[2], p[3], [7]]


def run_batched(model, kv: str, batch_invariant: bool) -> tuple[dict[int, list[int]], dict, Scheduler]:
    """Greedy decoding of every prompt at once -> each request's output, each request's logits
    at its sampled rows ((n_out, vocab_size)), and the scheduler (its counts)."""
    cpu = CpuEngine(model, seq_len=SEQ_LEN, kv_dtype=kv)
    blocks = BlockManager(64, BLOCK_SIZE)
    engine = BatchedCpuEngine(cpu.ref, blocks.n_blocks, BLOCK_SIZE, batch_invariant)
    sched = Scheduler(blocks, max_seqs=4, token_budget=7)
    lengths = (9, 5, 8, 6, 12)
    requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts(), lengths, strict=True))]
    for r in requests:
        sched.submit(r)
    logits: dict[int, list[np.ndarray]] = {r.id: [] for r in requests}
    mixed = 0  # steps that held a decode row and a prompt chunk
    while not sched.idle():
        plan = sched.schedule()
        a = plan.arrays()
        out = engine.step(a["tokens"], a["positions"], a["seq_of_row"], a["block_table"], a["sample_rows"])
        sampling = [c for c in plan.chunks if c.sample]
        for c, row in zip(sampling, out, strict=True):
            logits[c.seq].append(row)
        mixed += any(not c.prompt for c in plan.chunks) and any(c.prompt for c in plan.chunks)
        sched.finish_step(plan, {c.seq: int(row.argmax()) for c, row in zip(sampling, out, strict=True)})
        sched.check()
    assert mixed > 0 and requests[2].cached_tokens == 12  # the plans mixed rows; the prefix was reused
    assert sched.blocks.whole()
    outputs = {r.id: r.output for r in requests}
    return outputs, {i: np.stack(v) for i, v in logits.items()}, sched


@pytest.mark.parametrize("kv", ["fp32", "fp16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_give_the_token_steps_logits(models, arch, kv):
    outputs, logits, _ = run_batched(models[arch], kv, batch_invariant=False)
    for i, ids in enumerate(prompts()):
        want = token_logits(CpuEngine(models[arch], seq_len=SEQ_LEN, kv_dtype=kv), ids + outputs[i][:-1])
        want = want[len(ids) - 1 :]  # (n_out, vocab_size): the rows that sampled
        got = logits[i]
        assert got.shape == want.shape
        assert np.isfinite(want).all() and np.abs(want).max() > 1.0
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= TOLERANCE[kv], (i, err)
        assert (want.argmax(axis=1) == np.array(outputs[i])).all()  # alone, the same greedy tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariant_rows_are_the_token_steps_bits(models, arch):
    outputs, logits, _ = run_batched(models[arch], "fp16", batch_invariant=True)
    for i, ids in enumerate(prompts()):
        want = token_logits(CpuEngine(models[arch], seq_len=SEQ_LEN), ids + outputs[i][:-1])
        np.testing.assert_array_equal(logits[i], want[len(ids) - 1 :])
