"""The GPU engine's batched forward (pycalm.gpu.batched.BatchedGpuEngine): the continuous-batching
scheduler's plans (blocks of 4 positions, a budget of 5 rows, so prompts split into chunks and
decode rows share passes with other sequences' chunks) run on it, greedy, and each sequence's
logits at its sampled rows against the same engine's multi-token forward over that sequence alone
(GpuEngine.prefill_logits, itself checked against the NumPy reference in test_prefill.py).

The products are the same kernels on the same rows (skinny's K order does not depend on the
pass), so the first layer's keys and values are the same bits in the pool as in the engine's own
cache; attention (pycalm.kernels.attention over the pages against the split or prefill attention) sums
in another order, which moves the logits by a few 1e-4 relative (bound: 1e-3). A step of one row
runs the token step's kernels; with an fp8 cache its keys and values may sit one e5m2 step from
the engine's own, so its logits are held against the NumPy prefill over the pool's rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu import GPU
from test_prefill import check_kv, decoded, prefill_ref, rel_l2, tiny_model

from pycalm.app.batching import BatchRunner
from pycalm.batch.blocks import BlockManager
from pycalm.batch.scheduler import Request, Scheduler
from pycalm.cpu.reference import sample_ref
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.gpu.batched import BatchedGpuEngine
from pycalm.gpu.engine import EngineOptions, GpuEngine

SEQ_LEN = 32
BLOCK_SIZE = 4


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(9)
    return [[int(t) for t in rng.integers(3, 64, n)] for n in (7, 3, 5)]


# the simulator runs one case (a Python thread a GPU thread is slow); the GPU all three
@pytest.mark.parametrize(
    "arch,dtype,kv",
    [("llama", "fp16", "fp16")] + ([("qwen2", "q8", "fp8"), ("mixtral", "fp16", "fp16")] if GPU else []),
)
def test_batched_gpu_rows_are_the_sequences_alone(tmp_path, arch, dtype, kv):
    model = tiny_model(tmp_path, arch, dtype, n_layers=1 if not GPU else 2)
    blocks = BlockManager(24, BLOCK_SIZE)
    gpu = BatchedGpuEngine(GpuEngine(model, seq_len=SEQ_LEN, kv_dtype=kv), blocks.n_blocks, BLOCK_SIZE)
    sched = Scheduler(blocks, max_seqs=3, token_budget=5)
    requests = [Request(i, p, 2) for i, p in enumerate(prompts())]
    for r in requests:
        sched.submit(r)
    logits: dict[int, list[np.ndarray]] = {r.id: [] for r in requests}
    by_step: dict[int, list[bool]] = {r.id: [] for r in requests}  # each logits row: a one-row step's?
    tables: dict[int, list[int]] = {}  # each sequence's blocks, from its last plan
    mixed = 0  # steps that held a decode row and a prompt chunk
    lone: set[tuple[int, int]] = set()  # (sequence, position) of the steps of one sampled row
    while not sched.idle():
        plan = sched.schedule()
        a = plan.arrays()
        one = len(a["tokens"]) == 1 and len(a["sample_rows"]) == 1  # the token step's kernels
        if one:
            lone.add((plan.chunks[0].seq, int(a["positions"][0])))
        out = gpu.step(a["tokens"], a["positions"], a["seq_of_row"], a["block_table"], a["sample_rows"])
        sampling = [c for c in plan.chunks if c.sample]
        for c, row in zip(sampling, out, strict=True):
            logits[c.seq].append(row)
            by_step[c.seq].append(one)
        for c in plan.chunks:
            tables[c.seq] = list(c.table)
        mixed += any(not c.prompt for c in plan.chunks) and any(c.prompt for c in plan.chunks)
        sched.finish_step(plan, {c.seq: int(row.argmax()) for c, row in zip(sampling, out, strict=True)})
    assert mixed > 0
    alone = GpuEngine(model, seq_len=SEQ_LEN, kv_dtype=kv)
    pool_k = gpu.pools[0].k.copy_to_host()  # (n_blocks * 4, kv_dim) the first layer's keys
    for r in requests:
        ids = r.prompt + r.output[:-1]
        want = np.concatenate(list(alone.prefill_logits(ids, 0)))[
            len(r.prompt) - 1 :
        ]  # the rows that sampled
        got = np.stack(logits[r.id])
        assert got.shape == want.shape and np.all(np.isfinite(got))
        one = np.array(by_step[r.id])
        rows = [tables[r.id][t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(len(ids))]
        if kv == "fp8" and one.any():
            # a one-row step writes the token step's keys and values (q8: X rounded to int8 for
            # dp4a), and e5m2 puts an element that differs in the 4th digit on the neighbouring
            # value now and then (check_kv), which moves the logits by up to about 1%: the pool's
            # rows against the engine's own within check_kv, and the step's logits against the
            # NumPy prefill attending over the pool's rows (test_prefill's bound, 2e-3)
            pool = [tuple(decoded(c, kv)[rows] for c in (layer.k, layer.v)) for layer in gpu.pools]
            for (k, v), cache in zip(pool, alone.kv_caches, strict=True):
                check_kv(k, decoded(cache.k, kv)[: len(ids)], kv)
                check_kv(v, decoded(cache.v, kv)[: len(ids)], kv)
            over_pool = prefill_ref(model, kv, ids, over=pool)[0][len(r.prompt) - 1 :]
            assert rel_l2(got[one], over_pool[one]) < 2e-3, (r.id, rel_l2(got[one], over_pool[one]))
        # a rows pass's logits are the prefill's but for the order of its sums; a one-row step's
        # are the token step's (q8: X rounded to int8 for dp4a), held to test_prefill's bound
        # for the token step against the prefill (fp8: above)
        checks = [(~one, 1e-3)] + ([(one, 2e-3)] if kv == "fp16" else [])
        for rows_of, bound in checks:
            if rows_of.any():
                assert rel_l2(got[rows_of], want[rows_of]) < bound, (
                    r.id,
                    bound,
                    rel_l2(got[rows_of], want[rows_of]),
                )
        mine = alone.kv_caches[0].k.copy_to_host()[: len(ids)]
        # the rows pass's keys are the same bits; those of a one-row step are the token step's
        # (float32 matvecs): the same keys rounded once more or less
        passed = [t for t in range(len(ids)) if (r.id, t) not in lone]
        assert np.array_equal(pool_k[rows][passed].view(np.uint8), mine[passed].view(np.uint8))
        if kv == "fp16":
            np.testing.assert_allclose(
                pool_k[rows].astype(np.float32), mine.astype(np.float32), rtol=2e-3, atol=2e-3
            )
    assert lone, "no step of one row"


def test_batched_gpu_one_long_chunk_takes_the_prefill_tiles(tmp_path):
    """A step of one sequence's prompt chunk of more than 16 rows (one user's prompt) runs the
    prefill attention's tiles over that sequence's pages (shuffled blocks, the chunk padded to its
    bucket): its logits are the engine's own prefill of the prompt (rel 1e-3: the products' K
    split can differ with the rows), and a second chunk of the same prompt at position 20 too."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    engine = GpuEngine(model, seq_len=SEQ_LEN)
    gpu = BatchedGpuEngine(engine, 12, BLOCK_SIZE)
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, 64, 29)]  # 20 rows (a bucket of 32), then 9
    table = rng.permutation(12)[:8].astype(np.int32).reshape(1, 8)  # (1 sequence, 8 blocks of 4)
    first = gpu.step(prompt[:20], np.arange(20), np.zeros(20), table, [19])
    assert gpu.one_sequence
    second = gpu.step(prompt[20:], np.arange(20, 29), np.zeros(9), table, [8])
    want = np.concatenate(list(engine.prefill_logits(prompt, 0)))  # (29, vocab_size)
    assert rel_l2(first[0], want[19]) < 1e-3 and rel_l2(second[0], want[28]) < 1e-3


def test_batched_gpu_samples_each_row_with_its_options(tmp_path):
    """step_tokens draws each sampled row with its own options and coin on the device: the token
    sample_ref picks from the logits step gives for the same rows, and the kept rows' logits are
    step's bits."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    gpu = BatchedGpuEngine(GpuEngine(model, seq_len=SEQ_LEN), 12, BLOCK_SIZE)
    some = [p[:2] for p in prompts()]  # three prompts of 2 tokens, each fed whole, its last row sampled
    tokens = np.concatenate(some)
    seq_of_row = np.repeat(np.arange(3), 2)
    positions = np.tile(np.arange(2), 3)
    table = np.arange(3, dtype=np.int32).reshape(3, 1)  # (3 sequences, 1 block)
    last = np.array([1, 3, 5])
    want = gpu.step(tokens, positions, seq_of_row, table, last)  # (3, vocab_size)
    options = [SamplingParams(), SamplingParams(0.8, top_k=5), SamplingParams(1.3, top_p=0.9, min_p=0.02)]
    coins = [0.1, 0.7, 0.93]
    # stale bits (NaN options) in the pinned buffer, which padding rows must not take
    for h in gpu.hosts:
        h[:] = -1
    chosen, kept = gpu.step_tokens(tokens, positions, seq_of_row, table, last, options, coins, keep=[2, 0])
    picks = [
        sample_ref(w, o.temperature, o.top_k, o.top_p, o.min_p, c)
        for w, o, c in zip(want, options, coins, strict=True)
    ]
    assert chosen.tolist() == picks
    assert np.array_equal(kept, want[[2, 0]])
    # the bucket's padding row (3 sampled rows run as 4) is greedy with coin 0
    assert [gpu.row_sampling.temperature.copy_to_host()[3], gpu.coins.copy_to_host()[3]] == [0.0, 0.0]
    with pytest.raises(PycalmError, match="3 samplings and coins"):
        gpu.step_tokens(tokens, positions, seq_of_row, table, last, options[:2], [0.1, 0.2])


def test_batched_gpu_runs_ahead(tmp_path):
    """enqueue_tokens: each step enqueued before the host reads the last one's tokens, its decode
    rows feeding them on the device (prev), gives the tokens of the same steps taken one at a time
    with the tokens given (step_tokens): three prompts, then a decode row each (the rows pass),
    then one sequence's decode row alone (the token step's path, which reads its token from the
    step's state)."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    engine = GpuEngine(model, seq_len=SEQ_LEN)
    some = [p[:2] for p in prompts()]
    greedy = [SamplingParams()] * 3
    table = np.arange(3, dtype=np.int32).reshape(3, 1)  # (3 sequences, 1 block each)
    feed = (
        np.concatenate(some),
        np.tile(np.arange(2), 3),
        np.repeat(np.arange(3), 2),
        table,
        np.array([1, 3, 5]),
    )
    decode = (np.arange(3), table, np.arange(3))  # seq_of_row, table, sample_rows: a row each at position 2
    results = []
    for ahead in (False, True):
        gpu = BatchedGpuEngine(engine, 12, BLOCK_SIZE)
        if not ahead:  # one step at a time, each decode row's token given
            first, _ = gpu.step_tokens(*feed, greedy, [0.0] * 3)
            second, _ = gpu.step_tokens(first, np.full(3, 2), *decode, greedy, [0.0] * 3)
            third, _ = gpu.step_tokens(second[:1], [3], [0], table[:1], [0], greedy[:1], [0.0])
        else:  # each step enqueued before the one before it is read: the tokens zero, prev naming them
            t1 = gpu.enqueue_tokens(*feed, greedy, [0.0] * 3)
            t2 = gpu.enqueue_tokens(np.zeros(3), np.full(3, 2), *decode, greedy, [0.0] * 3, prev=np.arange(3))
            first = gpu.collect(t1)
            t3 = gpu.enqueue_tokens([0], [3], [0], table[:1], [0], greedy[:1], [0.0], prev=[0])
            second, third = gpu.collect(t2), gpu.collect(t3)
        results.append((first.tolist(), second.tolist(), third.tolist()))
    assert results[0] == results[1]
    with pytest.raises(PycalmError, match="prev"):
        gpu.enqueue_tokens([0], [3], [0], table[:1], [0], greedy[:1], [0.0], prev=[0, 1])


def test_batched_gpu_one_row_is_the_token_step(tmp_path):
    """A step of one sampled row runs the engine's token step over the pool: after a prompt fed
    as one chunk (the rows pass), each decode row's logits are the bits of the same engine's token
    step over its own cache (GpuEngine.logits), its key lands in its pool row, and step_tokens
    draws sample_ref's token from those logits."""
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    gpu = BatchedGpuEngine(GpuEngine(model, seq_len=SEQ_LEN), 8, BLOCK_SIZE)
    alone = GpuEngine(model, seq_len=SEQ_LEN)
    prompt = prompts()[0]  # 7 tokens
    table = np.array([[5, 2, 7]], np.int32)  # positions 0-3 in block 5, 4-7 in 2, 8-11 in 7
    n = len(prompt)
    first = gpu.step(prompt, np.arange(n), np.zeros(n, np.int32), table, [n - 1])[0]
    list(alone.prefill_logits(prompt, 0))
    token, tokens = int(first.argmax()), []
    for pos in range(n, n + 2):
        got = gpu.step([token], [pos], [0], table, [0])[0]
        want = alone.logits(token, pos)
        assert np.all(np.isfinite(got)) and np.array_equal(got, want), pos
        tokens.append(token)
        token = int(want.argmax())
    pool_k, mine = gpu.pools[0].k.copy_to_host(), alone.kv_caches[0].k.copy_to_host()
    rows = [table[0, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(n + 2)]
    assert np.array_equal(pool_k[rows].view(np.uint8), mine[: n + 2].view(np.uint8))
    option = SamplingParams(0.9, top_k=7)
    chosen, kept = gpu.step_tokens([token], [n + 2], [0], table, [0], [option], [0.42], keep=[0])
    want = alone.logits(token, n + 2)
    assert np.array_equal(kept[0], want)
    assert chosen.tolist() == [sample_ref(want, 0.9, 7, 1.0, 0.0, 0.42)]


def test_batched_gpu_refuses_bad_steps(tmp_path):
    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    gpu = BatchedGpuEngine(GpuEngine(model, seq_len=SEQ_LEN), 8, BLOCK_SIZE)
    table = np.array([[0, 1]], np.int32)
    one = np.zeros(1, np.int32)
    with pytest.raises(PycalmError, match="outside the vocabulary"):
        gpu.step(np.array([64]), one, one, table, one)
    with pytest.raises(PycalmError, match="past its block table"):
        gpu.step(one, np.array([8]), one, table, one)
    with pytest.raises(PycalmError, match="outside the pool"):
        gpu.step(one, one, one, np.array([[8]], np.int32), one)
    with pytest.raises(PycalmError, match="batch-invariant"):
        inv = GpuEngine(model, seq_len=SEQ_LEN, options=EngineOptions(batch_invariant=True))
        BatchedGpuEngine(inv, 8, BLOCK_SIZE)


def test_batch_runner_on_the_gpu_engine(tmp_path):
    """The server's --parallel runner over the GPU engine: two greedy requests at once, each
    the text the same LLM gives for that prompt alone (the token step's float32 products against
    the batched pass's fp16 ones: no near tie in this model's few tokens). One is drawn on the
    device; the other has a repetition penalty and asks for logprobs (its logits come to the
    host, its token drawn there, its logprobs the model's)."""
    from pycalm.app.api import LLM
    from pycalm.model.tokenizer import Tokenizer

    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    cfg = model.config
    tok = Tokenizer.from_blob(
        model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
    )
    llm = LLM(GpuEngine(model, seq_len=SEQ_LEN), tok)
    # (a budget that feeds both prompts in one step: the chunked plans are the test above's)
    runner = BatchRunner(llm, max_seqs=3, block_size=BLOCK_SIZE, token_budget=16)
    some = prompts()[1:]
    options = [dict(repetition_penalty=1.5, logprobs=2), {}]
    streams = [
        runner.add(p, 2, SamplingParams(temperature=0.0, repetition_penalty=o.get("repetition_penalty", 1.0)),
                   lambda *_: None, logprobs=o.get("logprobs"))
        for p, o in zip(some, options, strict=True)
    ]  # fmt: skip
    # where each hand-out of tokens runs: inside step_tokens (while the GPU runs the next step)
    # but for the last, which has no next step
    inside, where = [False], []
    step_tokens = runner.engine.step_tokens

    def tracked(*args: object, **kwargs: object) -> object:
        inside[0] = True
        try:
            return step_tokens(*args, **kwargs)
        finally:
            inside[0] = False

    runner.engine.step_tokens = tracked
    runner.on_events = lambda: where.append(inside[0])
    while not runner.idle():
        runner.step()
    # three steps: the prompts (nothing to hand out yet), the second tokens (the first ones handed
    # out meanwhile), and the last hand-out, with no pass left to overlap
    assert where == [True, True, False]
    # each graph captured is counted once, with the host's time of its first step (/metrics);
    # the simulator captures none
    m = runner.metrics()
    assert m["captures"] == len(runner.engine.graphs) and (m["capture_s"] > 0) == (m["captures"] > 0)
    for p, o, s in zip(some, options, streams, strict=True):
        alone = llm.generate(p, max_tokens=2, temperature=0.0, **o)  # the text (a Generation with logprobs)
        assert s.gen.finish_reason in ("stop", "length") and s.gen.completion_tokens == len(s.request.output)
        if "logprobs" in o:
            assert [x.token for x in s.gen.logprobs] == [x.token for x in alone.logprobs]
            assert [x.top_ids for x in s.gen.logprobs] == [x.top_ids for x in alone.logprobs]
            # (the two forwards' logits differ by about 1e-3 relative: the module docstring)
            np.testing.assert_allclose(
                [x.logprob for x in s.gen.logprobs], [x.logprob for x in alone.logprobs], atol=1e-2
            )
            alone = alone.text
        assert s.gen.text == alone and alone


@pytest.mark.skipif(GPU, reason="the GPU's free memory stands in for a small one")
def test_pool_takes_the_memory_there_is(tmp_path, monkeypatch):
    """Without a pool size given, the paged pool takes a full context for every sequence where
    that fits the GPU's free memory (less the reserve), else as many blocks as fit, and at least
    one full context: short of that, loading fails with the out-of-memory line."""
    import pycalm.gpu.batched as batched
    import pycalm.gpu.memory as memory
    from pycalm.app.api import LLM
    from pycalm.model.tokenizer import Tokenizer

    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    cfg = model.config
    engine = GpuEngine(model, seq_len=SEQ_LEN)
    block_bytes = 2 * cfg.n_layers * BLOCK_SIZE * cfg.kv_dim * 2  # keys and values, fp16
    total = 8 << 30  # (5% of it is below RESERVE_MIN: the reserve is RESERVE_MIN)

    def free_for(blocks: float) -> None:
        info = lambda: (batched.RESERVE_MIN + blocks * block_bytes, total)  # noqa: E731
        monkeypatch.setattr(batched, "gpu_memory_info", info)
        monkeypatch.setattr(memory, "gpu_memory_info", info)

    full = SEQ_LEN // BLOCK_SIZE  # blocks of one full context
    free_for(2.5 * full)
    assert BatchedGpuEngine(engine, 4 * full, BLOCK_SIZE, min_blocks=full).n_blocks == int(2.5 * full)
    assert BatchedGpuEngine(engine, 2 * full, BLOCK_SIZE, min_blocks=full).n_blocks == 2 * full
    tok = Tokenizer.from_blob(
        model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
    )
    runner = BatchRunner(LLM(engine, tok), max_seqs=4, block_size=BLOCK_SIZE)
    assert runner.blocks.n_blocks == int(2.5 * full)  # the scheduler hands out the pool's blocks
    free_for(full - 1)
    with pytest.raises(PycalmError, match=r"^out of GPU memory: the paged KV pool of 8 blocks"):
        BatchRunner(LLM(engine, tok), max_seqs=4, block_size=BLOCK_SIZE)
    assert BatchedGpuEngine(engine, 12, BLOCK_SIZE).n_blocks == 12  # a size given is taken whole


def test_batch_runner_runs_ahead_on_the_gpu_engine(tmp_path):
    """Greedy requests whose rows are all drawn on the device run ahead (each step enqueued before
    the last one's tokens are read): every request's tokens are the ones the same LLM gives it
    alone, cut at its EOS (one request meets one: a token of its own reply taken as the model's
    EOS) or at max_tokens, and its finish reason says which; no step waited for its own tokens."""
    from pycalm.app.api import LLM
    from pycalm.model.tokenizer import Tokenizer

    model = tiny_model(tmp_path, "llama", "fp16", n_layers=1)
    cfg = model.config
    tok = Tokenizer.from_blob(
        model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
    )
    llm = LLM(GpuEngine(model, seq_len=SEQ_LEN), tok)
    some, limits = prompts(), [3, 2, 4]
    alone = [
        [x.token for x in llm.generate(p, max_tokens=n, temperature=0.0, logprobs=1).logprobs]
        for p, n in zip(some, limits, strict=True)
    ]
    eos = next(
        t for i, t in enumerate(alone[2]) if 0 < i < 3 and t not in alone[2][:i]
    )  # ends request 2 early
    runner = BatchRunner(llm, max_seqs=3, block_size=BLOCK_SIZE, token_budget=16)
    assert runner.ahead
    runner.eos = frozenset({eos})
    calls = {"enqueue_tokens": 0, "step_tokens": 0}
    for name in calls:
        method = getattr(runner.engine, name)

        def counted(*args: object, _m: object = method, _n: str = name, **kwargs: object) -> object:
            calls[_n] += 1
            return _m(*args, **kwargs)

        setattr(runner.engine, name, counted)
    streams = [runner.add(p, n, SamplingParams(), lambda *_: None) for p, n in zip(some, limits, strict=True)]
    while not runner.idle():
        runner.step()
    cuts = [want[: want.index(eos) + 1] if eos in want else want for want in alone]
    assert calls["step_tokens"] == 0 and calls["enqueue_tokens"] == max(map(len, cuts))
    for s, want, cut in zip(streams, alone, cuts, strict=True):
        assert s.request.output == cut
        assert s.gen.finish_reason == ("stop" if eos in want else "length")
        assert s.gen.completion_tokens == len(cut)
    assert runner.blocks.whole() and runner.inflight is None
