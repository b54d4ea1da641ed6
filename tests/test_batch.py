"""The paged KV cache's block manager and the continuous-batching scheduler (pycalm.batch): pure
Python, no engine. A fake pool (one token id a row, written and read through the block tables in
the paged attention's layout) stands in for the keys and values, so reuse and recompute are checked
by what a pass would read, not only by the counts."""

from __future__ import annotations

import random
import zlib
from array import array

import numpy as np
import pytest

from pycalm.batch.blocks import BlockManager, OutOfBlocks
from pycalm.batch.scheduler import FINISHED, PENDING, Plan, Request, Scheduler
from pycalm.errors import PycalmError


def pool_row(table, t: int, block_size: int) -> int:
    """the paged attention's layout: key t of a sequence lives in this pool row."""
    return table[t >> (block_size.bit_length() - 1)] * block_size + (t & (block_size - 1))


def write(pool: np.ndarray, m: BlockManager, seq: int, n: int) -> None:
    """An engine's writes: positions [computed, n) of seq into the pool, then `computed`. Every
    block written is the sequence's alone (the sharing rule)."""
    s = m.seqs[seq]
    for t in range(s.computed, n):
        block = s.table[t // m.block_size]
        assert m.ref_count[block] == 1 and m.key[block] is None, f"position {t} writes a shared block"
        pool[pool_row(s.table, t, m.block_size)] = s.tokens[t]
    m.computed(seq, n)


def read(pool: np.ndarray, m: BlockManager, seq: int, n: int) -> list[int]:
    """What a pass reads for positions [0, n) of seq through its table."""
    table = m.seqs[seq].table
    return [int(pool[pool_row(table, t, m.block_size)]) for t in range(n)]


# -- the block manager ---------------------------------------------------------------------------


def test_prefix_reuse_takes_full_blocks_only():
    bs = 4
    m = BlockManager(16, bs)
    pool = np.full(16 * bs, -1, np.int64)  # (n_blocks * block_size,) a token id a row
    first = list(range(100, 113))  # 13 tokens: 3 full blocks and one more
    assert m.allocate(1, first) == 0
    write(pool, m, 1, 13)
    m.check()
    second = first[:10] + [7, 7, 7, 7, 7]  # shares 2.5 blocks
    assert m.allocate(2, second) == 2 * bs
    assert m.seqs[2].table[:2] == m.seqs[1].table[:2] and m.seqs[2].table[2] != m.seqs[1].table[2]
    assert m.seqs[2].cached_tokens == 2 * bs and m.hit_tokens == 2 * bs
    assert read(pool, m, 2, 2 * bs) == second[: 2 * bs]  # the reused rows hold the prompt's tokens
    write(pool, m, 2, len(second))
    m.check()
    exact = first[:8]  # exactly 2 cached blocks: the last token is fed, so only 1 is reused
    assert m.allocate(3, exact) == bs
    m.check()
    for seq in (1, 2, 3):
        m.free_seq(seq)
        m.check()
    assert m.whole() and m.cached > 0
    # eviction pressure: a sequence of the whole pool evicts every cached block
    assert m.allocate(4, list(range(500, 500 + 16 * bs))) == 0
    m.free_seq(4)
    assert m.allocate(5, first) == 0 and m.by_key == {}
    m.free_seq(5)
    m.check()
    assert m.whole()
    assert m.hit_rate == pytest.approx((2 * bs + bs) / (13 + 15 + 8 + 16 * bs + 13))


def test_lru_evicts_the_least_recently_released_and_tails_first():
    m = BlockManager(4, 2)
    a, b = [1, 2, 9], [3, 4, 9]
    m.allocate(1, a)
    m.computed(1, 3)
    m.allocate(2, b)
    m.computed(2, 3)
    a0, b0 = m.seqs[1].table[0], m.seqs[2].table[0]
    m.free_seq(1)
    m.free_seq(2)
    assert list(m.lru) == [a0, b0] and m.free == 2
    m.allocate(3, [1, 2, 7])  # reuses a0: released again, it becomes the most recent
    assert m.seqs[3].table[0] == a0
    m.free_seq(3)
    assert list(m.lru) == [b0, a0]
    m.allocate(4, [5, 6, 7, 8, 9])  # 3 blocks: the 2 free ones, then b0 evicted
    assert m.match(b) == [] and m.match(a) == [a0]
    m.free_seq(4)
    m.check()
    # a chain is released tail first, so its tail is evicted first
    m = BlockManager(5, 2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    m.allocate(1, tokens)
    m.computed(1, 7)
    chain = m.seqs[1].table[:3]
    m.free_seq(1)
    assert list(m.lru) == chain[::-1]
    m.allocate(2, [8, 8, 8, 8, 8])  # 3 blocks: 2 free, then the chain's tail
    assert m.match(tokens) == chain[:2]
    m.free_seq(2)
    m.check()
    assert m.whole()


def test_out_of_blocks_changes_nothing():
    m = BlockManager(3, 2)
    m.allocate(1, [1, 2, 3, 4])
    m.computed(1, 4)
    with pytest.raises(OutOfBlocks):
        m.allocate(2, [5, 6, 7])
    assert not m.can_allocate([5, 6, 7]) and m.can_allocate([1, 2, 3, 4, 5])  # one block reused
    m.append(1, 5)  # position 4 starts the third block
    with pytest.raises(OutOfBlocks):
        m.allocate(2, [9])
    m.append(1, 6)
    with pytest.raises(OutOfBlocks):
        m.append(1, 7)
    assert m.seqs[1].tokens == [1, 2, 3, 4, 5, 6] and m.used == 3
    m.check()
    with pytest.raises(ValueError, match="power of two"):
        BlockManager(4, 6)


def test_block_manager_random_soak():
    """A few thousand random allocations, appends, engine writes and frees (a freed sequence
    standing for a cancellation too), check() after each; what a sequence reads through its table
    is always its tokens; the pool is whole at the end."""
    rng = random.Random(31)
    bs, n_blocks = 4, 40
    m = BlockManager(n_blocks, bs)
    pool = np.full(n_blocks * bs, -1, np.int64)  # (n_blocks * block_size,)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    next_id, failures = 0, 0
    for _ in range(4000):
        op = rng.random()
        live = list(m.seqs)
        if op < 0.3 or not live:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 20)] + [
                rng.randrange(50) for _ in range(rng.randrange(0, 12))
            ]
            before = (m.used, m.free, m.cached, dict(m.by_key))
            try:
                cached = m.allocate(next_id, tokens)
            except OutOfBlocks:
                failures += 1
                assert (m.used, m.free, m.cached, m.by_key) == before
            else:
                assert read(pool, m, next_id, cached) == tokens[:cached]
                next_id += 1
        elif op < 0.55:
            seq = rng.choice(live)
            try:
                m.append(seq, rng.randrange(50))
            except OutOfBlocks:
                failures += 1
        elif op < 0.85:
            seq = rng.choice(live)
            s = m.seqs[seq]
            write(pool, m, seq, rng.randint(s.computed, len(s.tokens)))
            assert read(pool, m, seq, s.computed) == s.tokens[: s.computed]
        else:
            m.free_seq(rng.choice(live))
        m.check()
    assert failures > 0 and m.hit_tokens > 0  # the soak reached a full pool and reused prefixes
    for seq in list(m.seqs):
        m.free_seq(seq)
        m.check()
    assert m.whole()


# -- the scheduler -------------------------------------------------------------------------------

VOCAB, STOP = 50, 0


def next_token(context: list[int]) -> int:
    """The fake model: the next token is a hash of the whole context."""
    return zlib.crc32(array("q", context).tobytes()) % VOCAB


def run_plan(
    plan: Plan, pool: np.ndarray, m: BlockManager, device: dict[int, int] | None = None
) -> dict[int, int]:
    """A fake engine's pass over a plan's arrays: every row writes its token to its pool row,
    then each sampled row reads its context through its block table. A PENDING token is the one
    the engine sampled for that request in its last pass (`device`: request id -> token), as the
    GPU's rows read theirs."""
    a = plan.arrays()
    assert a["block_table"].tolist() == [  # (the scheduler's TableRows: each table, padded with 0)
        c.table + [0] * (a["block_table"].shape[1] - len(c.table)) for c in plan.chunks
    ]
    for r in np.flatnonzero(a["tokens"] == PENDING):
        a["tokens"][r] = device[plan.chunks[a["seq_of_row"][r]].seq]
    bs, log2 = m.block_size, m.block_size.bit_length() - 1
    rows = a["block_table"][a["seq_of_row"], a["positions"] >> log2] * bs + (
        a["positions"] & (bs - 1)
    )  # (R,)
    for row in rows:
        block = int(row) // bs
        assert m.ref_count[block] == 1 and m.key[block] is None, "a row writes a shared block"
    pool[rows] = a["tokens"]
    sampled = {}
    for r in a["sample_rows"]:
        s, p = a["seq_of_row"][r], a["positions"][r]
        table = a["block_table"][s]
        context = [int(pool[pool_row(table, t, bs)]) for t in range(p + 1)]
        sampled[plan.chunks[s].seq] = next_token(context)
    return sampled


def alone(prompt: list[int], n: int) -> list[int]:
    """The same fake model run on one request by itself."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
@pytest.mark.parametrize("seed, bs", [(7, 4), (8, 2), (9, 8)])
def test_scheduler_simulated_run(seed, bs, ahead):
    """Requests arrive over time with random lengths and shared prefixes; a pool too small for all
    of them forces preemptions; random cancellations. Every step keeps the token budget and the
    invariants; every request ends (none lost), each output is what the request gives alone, no
    request stays at the head of the queue long, and the pool is whole at the end. ahead: each
    step is planned and run before the last one's tokens are read (assume, then resolve one step
    later, as a GPU that samples on the device runs ahead)."""
    rng = random.Random(seed)
    n_blocks, max_seqs, budget = 96 // bs, 6, 16  # 96 positions; a request takes up to 69
    m = BlockManager(n_blocks, bs)
    sched = Scheduler(m, max_seqs=max_seqs, token_budget=budget)
    pool = np.full(n_blocks * bs, -1, np.int64)  # (n_blocks * block_size,)
    system = [[rng.randrange(1, VOCAB) for _ in range(12)] for _ in range(3)]
    requests, arrivals = [], {}
    for i in range(120):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
        prompt = (rng.choice(system)[: rng.randrange(0, 13)] + tail) if rng.random() < 0.7 else tail
        requests.append(Request(i, prompt, max_tokens=rng.randrange(1, 40), stop_tokens=frozenset({STOP})))
        arrivals[i] = rng.randrange(0, 300)
    with pytest.raises(PycalmError, match="KV blocks"):
        sched.submit(Request(999, [1] * 60, max_tokens=60))
    ended: dict[int, Request] = {}
    inflight, device = None, {}  # (ahead) the last step's slots and tokens; request id -> its token
    head_since: dict[int, int] = {}
    longest_at_head = 0
    cancelled = set()
    bound = max_seqs * (
        31 + 40
    )  # every running sequence ahead finishes: its prompt and output, a token a step
    for step in range(10_000):
        for r in requests:
            if arrivals[r.id] == step:
                sched.submit(r)
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(list(sched.requests))
            sched.cancel(victim)
            cancelled.add(victim)
        plan = sched.schedule()
        sched.check(plan)
        assert plan.n_rows <= budget
        for r in plan.finished:
            ended[r.id] = r
        if sched.waiting:
            head = sched.waiting[0].id
            head_since = {head: head_since.get(head, step)}
            longest_at_head = max(longest_at_head, step - head_since[head])
        else:
            head_since = {}
        sampled = run_plan(plan, pool, m, device)
        assert set(sampled) == {c.seq for c in plan.chunks if c.sample}
        if not ahead:
            for r in sched.finish_step(plan, sampled):
                ended[r.id] = r
        else:  # the last step's tokens read now, this step's assumed
            if inflight is not None:
                for r in sched.resolve(*inflight):
                    ended[r.id] = r
                sched.check()
            slots, done = sched.assume(plan)
            for r in done:
                ended[r.id] = r
            inflight = (slots, [sampled[r.id] for r, _ in slots])
            device = sampled
        sched.check()
        if step > max(arrivals.values()) and sched.idle():
            break
    else:
        pytest.fail("the run did not end")
    if inflight is not None:
        for r in sched.resolve(*inflight):
            ended[r.id] = r
    assert sorted(ended) == list(range(len(requests))), "a request was lost"
    assert sched.preemptions > 0, "the pool was never short"
    assert m.hit_tokens > 0, "no prefix was reused"
    assert longest_at_head <= bound
    for r in requests:
        assert r.state == FINISHED
        assert r.output == alone(r.prompt, len(r.output)), f"request {r.id} differs from its run alone"
        if r.finish_reason == "cancelled":
            assert r.id in cancelled
        elif r.finish_reason == "stop":
            assert r.output[-1] == STOP and STOP not in r.output[:-1] and len(r.output) <= r.max_tokens
        else:
            assert r.finish_reason == "length" and len(r.output) == r.max_tokens and STOP not in r.output
    assert m.whole() and not sched.running and not sched.waiting
    metrics = sched.metrics()
    assert (
        metrics["kv_blocks_used"] == 0 and metrics["kv_blocks_free"] + metrics["kv_blocks_cached"] == n_blocks
    )


def test_table_rows_follow_growing_and_new_tables():
    """TableRows (the plans' block tables kept from step to step) gives each chunk's table padded
    with 0, as the tables grow, are replaced by new lists (a preemption's recompute), and come and
    go (more sequences than its rows, its rows freed and doubled)."""
    from pycalm.batch.scheduler import Chunk, TableRows

    rng = random.Random(3)
    rows = TableRows()
    tables: dict[int, list[int]] = {}
    for _ in range(300):
        for seq in rng.sample(range(60), rng.randrange(1, 40)):  # some of the sequences
            t = tables.setdefault(seq, [])
            if rng.random() < 0.05:  # a new list, as an allocation makes
                t = tables[seq] = [rng.randrange(1000) for _ in range(rng.randrange(1, 5))]
            t += [rng.randrange(1000) for _ in range(rng.randrange(0, 3) if t else 1)]
        planned = [seq for seq in tables if rng.random() < 0.6]
        chunks = [Chunk(seq, 0, [1], True, tables[seq]) for seq in planned]
        width = max((len(c.table) for c in chunks), default=0) + rng.randrange(0, 3)
        got = rows.block_table(chunks, width)
        assert got.dtype == np.int32 and got.shape == (len(chunks), width)
        assert got.tolist() == [c.table + [0] * (width - len(c.table)) for c in chunks]
    assert len(rows.rows) > 16 and rows.rows.shape[1] > 16  # (it grew both ways)


def test_scheduler_budget_and_chunked_prefill():
    """A long prompt is fed in chunks within the budget beside the decode rows of running ones."""
    m = BlockManager(64, 4)
    sched = Scheduler(m, max_seqs=4, token_budget=8)
    sched.submit(Request(0, [1, 2, 3], max_tokens=10))
    sched.submit(Request(1, list(range(1, 21)), max_tokens=2))
    plan = sched.schedule()
    assert [(c.seq, c.start, len(c.tokens), c.sample) for c in plan.chunks] == [
        (0, 0, 3, True),
        (1, 0, 5, False),
    ]
    sched.finish_step(plan, {0: 5})
    plan = sched.schedule()  # request 0 decodes one row; request 1 takes the other 7
    assert [(c.seq, c.start, len(c.tokens), c.sample, c.prompt) for c in plan.chunks] == [
        (0, 3, 1, True, False),
        (1, 5, 7, False, True),
    ]
    a = plan.arrays()
    assert a["positions"].tolist() == [3, 5, 6, 7, 8, 9, 10, 11] and a["seq_of_row"].tolist() == [0] + [1] * 7
    assert a["sample_rows"].tolist() == [0] and a["block_table"].shape == (2, 5)
    with pytest.raises(ValueError, match="budget"):
        Scheduler(m, max_seqs=8, token_budget=4)


def test_a_step_recorded_in_full_after_one_run_ahead():
    """A step assumed (run ahead), then the next one planned, then the first resolved: a request
    that ends there on its stop token is in the next plan, whose tokens finish_step then records
    (a step that waits for its own tokens follows one that ran ahead): its row is dropped, the
    others' are recorded, and the pool is whole once they end."""
    m = BlockManager(16, 4)
    sched = Scheduler(m, max_seqs=4, token_budget=8)
    sched.submit(Request(0, [1, 2, 3], max_tokens=5, stop_tokens=frozenset({STOP})))
    sched.submit(Request(1, [4, 5], max_tokens=2, stop_tokens=frozenset({STOP})))
    slots, _ = sched.assume(first := sched.schedule())
    second = sched.schedule()  # both decode, feeding the tokens not read yet
    assert [c.seq for c in second.chunks] == [0, 1] and [c.tokens for c in second.chunks] == [[PENDING]] * 2
    ended = sched.resolve(slots, [STOP, 9])  # request 0 ends on its stop token
    assert [r.id for r in ended] == [0] and len(first.chunks) == 2
    ended = sched.finish_step(second, {0: 7, 1: 8})  # request 0's row dropped, request 1 at max_tokens
    assert [(r.id, r.finish_reason, r.output) for r in ended] == [(1, "length", [9, 8])]
    sched.check()
    assert sched.idle() and m.whole()


def test_a_step_without_decode_rows_takes_the_prefill_budget():
    """No sequence decoding: a prompt is fed in steps of the prefill budget; once one decodes,
    the others' prompts go in chunks within the token budget beside its row."""
    m = BlockManager(64, 4)
    sched = Scheduler(m, max_seqs=4, token_budget=8, prefill_budget=32)
    sched.submit(Request(0, list(range(1, 41)), max_tokens=3))  # 40 prompt tokens
    plan = sched.schedule()
    assert [(c.seq, c.start, len(c.tokens), c.sample) for c in plan.chunks] == [(0, 0, 32, False)]
    sched.check(plan)
    sched.finish_step(plan, {})
    sched.submit(Request(1, list(range(100, 130)), max_tokens=2))  # (no prefix shared with 0)
    plan = sched.schedule()  # still nobody decodes: request 0's last 8, then 24 of request 1's
    assert [(c.seq, c.start, len(c.tokens), c.sample) for c in plan.chunks] == [
        (0, 32, 8, True),
        (1, 0, 24, False),
    ]
    sched.check(plan)
    sched.finish_step(plan, {0: 7})
    plan = sched.schedule()  # request 0 decodes: request 1's rest within the token budget
    assert [(c.seq, len(c.tokens)) for c in plan.chunks] == [(0, 1), (1, 6)]
    sched.check(plan)
    assert Scheduler(m, max_seqs=4, token_budget=8).prefill_budget == 8  # (by default, the token budget)


def test_admission_keeps_a_spare_block_per_running_sequence_and_fifo():
    """The head is admitted only with one block to spare for each running sequence, and a head
    that does not fit holds back the smaller requests behind it."""
    m = BlockManager(6, 4)
    sched = Scheduler(m, max_seqs=4, token_budget=32)
    sched.submit(Request(0, [1] * 8, max_tokens=8))  # 2 blocks now
    sched.submit(Request(1, [2] * 16, max_tokens=2))  # 4 blocks: would leave no spare for request 0
    sched.submit(Request(2, [3], max_tokens=2))  # 1 block: fits, but waits behind request 1
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == [0] and [r.id for r in sched.waiting] == [1, 2]
    sched.finish_step(plan, {0: 5})
    sched.check()
    for _ in range(7):
        plan = sched.schedule()
        assert [c.seq for c in plan.chunks] == [0]
        sched.finish_step(plan, {0: 5})
        sched.check()
    assert not sched.running and sched.schedule().chunks[0].seq == 1
