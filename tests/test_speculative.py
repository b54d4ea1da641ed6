"""Speculative decoding (pycalm.app.speculative): the rejection rule against its target
distribution, the n-gram drafter, adaptive k, and the loop against plain decoding.

The loop's exactness: on a batch-invariant engine (the CPU engine's forward_rows then runs a
token step a row, the bits plain decoding computes), the speculative output is plain decoding's,
token for token, greedy and sampled, whether the drafts are kept or replaced; and the KV cache
it leaves is plain decoding's, so the next logits are too. The drafts come from a scripted
drafter that knows plain decoding's output and spoils chosen drafts, so that the test decides
which are kept. The sampled rule is checked on synthetic p and q (chi-square), and once through
the loop with a drafter that samples its drafts from its own q.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gpu import gpu_only
from tiny_models import make_hf_llama

from pycalm.app.speculative import (
    PRIOR,
    AdaptiveK,
    Draft,
    NgramDrafter,
    PassCosts,
    SpeculationOptions,
    SpeculativeEngine,
    measure_costs,
)
from pycalm.convert.main import convert
from pycalm.cpu.engine import CpuEngine
from pycalm.cpu.reference import speculative_accept_ref, target_distribution_ref, verify_ref
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError
from pycalm.model.loader import open_model

SEQ_LEN = 128
PROMPT = [5, 9, 11, 5, 9, 11, 5, 9]
GREEDY = SamplingParams()
# chi-square critical value at significance 1e-4 (scipy.stats.chi2.ppf(1 - 1e-4, dof)), by dof
CHI2_CRITICAL = {4: 23.51, 5: 25.74}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> object:
    tmp = tmp_path_factory.mktemp("spec")
    hf = make_hf_llama(tmp, arch="qwen2", vocab_size=64)
    return open_model(convert(hf.path, tmp / "m.pycalm", "fp16", progress=False))


def engine(model: object) -> CpuEngine:
    return CpuEngine(model, seq_len=SEQ_LEN, batch_invariant=True)


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------
# the rule on synthetic distributions


def test_rejection_rule_keeps_the_target_distribution():
    """A draft x ~ q kept with min(1, p / q), else a draw from max(0, p - q): over 20,000 draws the
    kept tokens follow p (chi-square below the 1e-4 critical value), where q is far from p."""
    rng = np.random.default_rng(0)
    p = np.array([0.05, 0.4, 0.1, 0.25, 0.0, 0.2])
    q = np.array([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    n = 20_000
    counts = np.zeros(6)
    kept = 0
    for x, u, v in zip(rng.choice(6, n, p=q), rng.random(n), rng.random(n), strict=True):
        accepted, token = speculative_accept_ref(p, q, int(x), u, v)
        counts[token] += 1
        kept += accepted
    assert counts[4] == 0  # p(4) = 0: never kept, never drawn
    live = p > 0
    assert chi_square(counts[live], p[live]) < CHI2_CRITICAL[int(live.sum()) - 1]
    # kept with probability sum min(p, q) = 0.6
    assert abs(kept / n - np.minimum(p, q).sum()) < 0.02
    # the same draws kept as they come (no rule) miss p by far
    assert chi_square(np.bincount(rng.choice(6, n, p=q), minlength=6)[live], p[live]) > 1000


def test_one_hot_draft_is_kept_with_probability_p():
    """q one-hot on x: x kept when u < p(x); otherwise the token comes from p without x."""
    p = np.array([0.2, 0.5, 0.3])
    q = np.array([0.0, 1.0, 0.0])
    assert speculative_accept_ref(p, q, 1, 0.49, 0.9) == (True, 1)
    assert speculative_accept_ref(p, q, 1, 0.51, 0.0) == (False, 0)
    assert speculative_accept_ref(p, q, 1, 0.51, 0.99) == (False, 2)  # 0.2 / 0.5 of the way: token 2
    with pytest.raises(PycalmError):
        speculative_accept_ref(p, q, 0, 0.5, 0.5)  # a draft its own q cannot give


def test_target_distribution_is_what_sample_ref_walks():
    logits = np.array([1.0, 3.0, 2.0, -1.0, 2.5])
    assert target_distribution_ref(logits, 0.0).tolist() == [0, 1, 0, 0, 0]
    p = target_distribution_ref(logits, 0.7, top_k=3)
    assert np.count_nonzero(p) == 3 and p[[1, 2, 4]].sum() == pytest.approx(1.0)
    full = np.exp(logits / 0.7 - (logits / 0.7).max())
    assert p[4] / p[1] == pytest.approx(full[4] / full[1])


def test_verify_stops_at_the_first_replaced_draft():
    p = np.eye(4)[[1, 2, 3]]  # (k + 1, vocab): the target wants 1, then 2, then 3
    q = np.eye(4)[[1, 0]]  # drafts 1 (right) then 0 (wrong)
    coins = np.full((3, 2), 0.5)
    assert verify_ref(p, q, [1, 0], coins) == [1, 2]
    assert verify_ref(p, np.eye(4)[[1, 2]], [1, 2], coins) == [1, 2, 3]  # all kept, and one more


# ---------------------------------------------------------------------------------------------
# the n-gram drafter


def test_ngram_takes_the_longest_latest_match():
    d = NgramDrafter()
    text = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    assert d.source(text) == 2  # "2 3" occurred twice before; "9 2 3"... no 3-gram "7 2 3" earlier
    assert d.propose(text, 3).tokens == [5, 7, 2]  # after the latest "2 3" (index 5..6)
    text = [*text, 5]  # "2 3 5" occurred: a 3-gram match
    assert d.source(text) == 3
    assert d.propose(text, 2).tokens == [7, 2]
    assert d.source([8, 8, 1]) is None  # the text changed: rebuilt, and 1 never occurred before


def test_ngram_runs_a_loop_on_past_the_text():
    d = NgramDrafter()
    text = [4, 6, 4, 6, 4]
    assert d.source(text) == 3  # "4 6 4" at 0..2, followed by 6
    assert d.propose(text, 5).tokens == [6, 4, 6, 4, 6]


def test_ngram_no_match_and_single_token():
    d = NgramDrafter()
    assert d.source([3]) is None
    assert d.source([3, 7, 1, 2]) is None
    assert d.source([3, 7, 1, 2, 7]) == 1
    assert d.propose([3, 7, 1, 2, 7], 2).tokens == [1, 2]


# ---------------------------------------------------------------------------------------------
# adaptive k

GROWING = PassCosts(1.0, ((2, 1.1), (4, 1.3), (8, 1.8), (16, 2.6), (64, 5.0)))


def test_k_grows_when_drafts_are_kept_and_stops_when_they_are_not():
    a = AdaptiveK(GROWING)
    assert a.plan("s", 0) == 3  # at the prior rate 0.5: 1.875 tokens for 1.3 steps
    for _ in range(10):
        a.update("s", a.plan("s", 0), kept=a.plan("s", 0))
    assert a.plan("s", 0) == 7  # nearly everything kept: a pass of 8 rows is worth 1.8 steps
    passes = 0
    while a.plan("s", 100):  # nothing kept from here on
        a.update("s", a.plan("s", 100), kept=0)
        passes += 1
    # the drafts of the last few passes decide: about 25 kept ones weigh against one replaced a
    # pass, so a dozen passes, k falling with the rate, before no k pays
    assert 10 <= passes <= 14
    assert a.off_until("s") == 116  # off: 16 plain tokens
    assert a.plan("s", 115) == 0
    assert a.plan("s", 116) >= 1  # a probe
    a.update("s", 1, kept=0)
    assert a.plan("s", 117) == 0 and a.off_until("s") == 117 + 32  # off twice as long
    assert a.plan("other", 117) == 3  # each source apart


def test_the_acceptance_is_drafts_kept_over_drafts_checked():
    """Each draft kept with probability 0.9, 7 a pass: the estimate (kept over checked, summed
    over the recent passes) averages 0.89 at DECAY 0.7 and 0.90 at the draft model's 0.9, where
    the mean of each pass's own kept / checked is 0.78 (a pass that stops at its first draft
    counts as much as one that keeps all 7), under where a draft model pays at the H100's costs."""
    from pycalm.app.speculative import DECAY, ModelDrafter

    for decay, low in ((DECAY, 0.87), (ModelDrafter.DECAY, 0.885)):
        rng, a, rates = np.random.default_rng(1), AdaptiveK(PassCosts.ratio(1.0)), []
        for _ in range(3000):
            kept = 0
            while kept < 7 and rng.random() < 0.9:
                kept += 1
            a.update("s", 7, kept, decay)
            rates.append(a.sources["s"].rate)
        assert low < np.mean(rates[50:]) < 0.91


def test_a_source_starts_from_its_drafters_prior():
    """At passes of 1.7 token steps a source seen for the first time drafts where its prior
    acceptance pays: n-gram lookup's 3-token matches (0.7: 3.1 tokens a pass of up to 9 rows)
    but not its 1-token ones (0.3: at most 1.43 tokens)."""
    drafter, a = NgramDrafter(), AdaptiveK(PassCosts.ratio(1.7))
    assert drafter.prior(1) < PRIOR < drafter.prior(3)
    assert a.plan(1, 0, drafter.prior(1)) == 0 and a.off_until(1) == 16
    assert a.plan(3, 0, drafter.prior(3)) == 8


def test_measured_pass_times_correct_the_model_online():
    """Online (costs measured on the engine), each pass's wall time moves the overhead, the
    seconds a pass takes beyond the model: passes 30% slower than modelled turn off a source
    whose acceptance pays at the model's costs (0.85 at the H100's: a pass of 8 rows 1.45 token
    steps, a draft step 0.41), one slow pass (a graph captured) moves it by at most
    (1 - OVERHEAD_DECAY) x OVERHEAD_STEP of a pass, and configured costs take no times."""
    from pycalm.app.speculative import OVERHEAD_DECAY, OVERHEAD_STEP

    costs = PassCosts(1.75e-3, ((2, 2.5e-3), (4, 2.5e-3), (8, 2.54e-3), (16, 2.8e-3)), 0.72e-3, feed_last=0.0)
    a = AdaptiveK(costs, online=True)
    k = a.plan("m", 0, 0.85)
    assert k >= 4 and a.best(0.85)[1] > 1.1
    modelled = costs.pass_time(k, 0.85)
    a.update("m", k, 3, seconds=100 * modelled)  # a pass that captured a graph
    assert a.overhead == pytest.approx((1 - OVERHEAD_DECAY) * OVERHEAD_STEP * modelled)
    produced = 0
    for _ in range(20):  # 30% over the model from here on, 0.85 of the drafts kept
        k = a.plan("m", produced, 0.85)
        if k == 0:
            break
        kept = int(0.85 * k)
        a.update("m", k, kept, seconds=1.3 * costs.pass_time(k, a.sources["m"].rate))
        produced += kept + 1
    rate = a.sources["m"].rate
    assert k == 0 and max(costs.speedup(j, rate) for j in range(1, 9)) > 1.0  # (the model alone drafts on)
    configured = AdaptiveK(PassCosts.ratio(1.2))
    configured.update("s", 4, 2, seconds=100.0)
    assert configured.overhead == 0.0
    # passes far faster than modelled (costs timed on a GPU still warming up): the overhead falls
    # a step at a time, and never makes a pass cost less than half its model
    fast = AdaptiveK(costs, online=True)
    fast.update("m", 7, 5, seconds=0.0)
    assert fast.overhead == pytest.approx(-(1 - OVERHEAD_DECAY) * OVERHEAD_STEP * costs.pass_time(7, PRIOR))
    for _ in range(100):
        fast.update("m", 7, 5, seconds=0.0)
    for j in range(1, 9):
        half = 0.5 * costs.pass_time(j, 0.9)
        assert costs.speedup(j, 0.9, fast.overhead) == pytest.approx(
            sum(0.9**i for i in range(j + 1)) * costs.step / half
        )


def test_the_loop_times_each_pass_where_it_measured_the_costs(model, monkeypatch):
    """SpeculativeEngine gives AdaptiveK each pass's wall time where the costs are measured
    on its engine (online: at the first call, or measured and given; the measurement stood in
    for by costs at which n-gram lookup pays), and AdaptiveK takes none where they are
    configured."""
    from pycalm.app import speculative

    measured = replace(PassCosts.ratio(1.5), measured=True)
    monkeypatch.setattr(speculative, "measure_costs", lambda *a, **k: measured)
    seen = []
    update = AdaptiveK.update
    monkeypatch.setattr(
        AdaptiveK, "update", lambda self, *a: (seen.append((self.online, a[-1])), update(self, *a))[1]
    )
    for options, online in (
        (SpeculationOptions(), True),
        (SpeculationOptions(costs=measured), True),
        (SpeculationOptions(costs=PassCosts.ratio(1.5)), False),
    ):
        seen.clear()
        spec = SpeculativeEngine(engine(model), NgramDrafter(), options)
        list(spec.generate(PROMPT, 0, 8, GREEDY))
        assert seen and all(o == online and seconds > 0 for o, seconds in seen)


def test_fixed_k_and_bad_options():
    assert AdaptiveK(None, fixed_k=5).plan("s", 0) == 5
    with pytest.raises(PycalmError):
        AdaptiveK(None)
    with pytest.raises(PycalmError):
        AdaptiveK(GROWING, k_most=64)


# ---------------------------------------------------------------------------------------------
# the loop against plain decoding


class ScriptDrafter:
    """Drafts the script (plain decoding's output after the prompt) except at `wrong` indices of
    it, where it drafts another token; counts the passes."""

    name = "script"

    def __init__(self, prompt: list[int], script: list[int], wrong: set[int], vocab: int) -> None:
        self.offset, self.script, self.wrong, self.vocab = len(prompt), script, wrong, vocab

    def source(self, context: list[int]) -> str | None:
        return "script" if len(context) - self.offset < len(self.script) else None

    def propose(self, context: list[int], k: int) -> Draft:
        i = len(context) - self.offset
        out = self.script[i : i + k]
        return Draft([(t + 1) % self.vocab if i + j in self.wrong else t for j, t in enumerate(out)])


@pytest.mark.parametrize("wrong", [set(), {0, 3, 4, 9, 17}, set(range(40))], ids=["kept", "some", "none"])
@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(1.0, top_k=8, seed=7)], ids=["greedy", "sampled"]
)
def test_speculative_output_is_plain_decodings(model, wrong, sampling):
    """Token for token, the kept drafts and the replaced ones alike, with 4 drafts a pass; then
    the cache holds plain decoding's keys and values and the next logits are plain decoding's."""
    plain_engine = engine(model)
    plain = list(plain_engine.generate(PROMPT, 0, 30, sampling))
    options = SpeculationOptions(k=4)
    spec = SpeculativeEngine(engine(model), ScriptDrafter(PROMPT, plain, wrong, 64), options)
    out = list(spec.generate(PROMPT, 0, 30, sampling))
    assert out == plain
    stats = options.stats
    n = len(plain)  # (sampled: it ends at an EOS)
    assert stats.pass_tokens + stats.plain_tokens == n
    if not wrong:
        assert stats.passes == -(-n // 5) and stats.kept >= n - stats.passes  # 5 tokens a pass
    if wrong == set(range(40)):  # a token a pass; the last one alone takes a plain step
        assert stats.kept == 0 and stats.passes + stats.plain_tokens == n
    end = len(PROMPT) + n - 1  # positions 0 .. end - 1 are in the cache, the last token is not
    ref_plain, ref_spec = plain_engine.ref, spec.engine.ref
    assert np.array_equal(ref_spec.key_cache[:, :end], ref_plain.key_cache[:, :end])
    assert np.array_equal(ref_spec.value_cache[:, :end], ref_plain.value_cache[:, :end])
    assert np.array_equal(spec.logits(plain[-1], end), plain_engine.logits(plain[-1], end))


def test_rejection_rolls_the_cache_back(model):
    """A pass whose drafts are all replaced writes cache rows past the kept token; the next call
    (a chat's next turn, from the position after the reply) reads plain decoding's logits."""
    plain_engine = engine(model)
    plain = list(plain_engine.generate(PROMPT, 0, 3, GREEDY))
    spec = SpeculativeEngine(engine(model), ScriptDrafter(PROMPT, plain, {1, 2}, 64), SpeculationOptions(k=2))
    assert list(spec.generate(PROMPT, 0, 3, GREEDY)) == plain
    pos = len(PROMPT) + 2  # where the last token goes; its pass wrote rows past it
    turn = [plain[-1], 7, 8]
    assert list(spec.generate(turn, pos, 5, GREEDY)) == list(plain_engine.generate(turn, pos, 5, GREEDY))


def test_stops_at_max_new_and_eos(model):
    plain_engine = engine(model)
    plain = list(plain_engine.generate(PROMPT, 0, 12, GREEDY))
    spec = SpeculativeEngine(engine(model), ScriptDrafter(PROMPT, plain, set(), 64), SpeculationOptions(k=8))
    assert list(spec.generate(PROMPT, 0, 7, GREEDY)) == plain[:7]  # never past max_new, mid-pass
    assert list(spec.generate(PROMPT, 0, 0, GREEDY)) == []
    # an EOS drafted and kept ends the output there
    eos = model.config.eos_ids[0]
    script = [*plain[:3], eos]
    spec = SpeculativeEngine(engine(model), ScriptDrafter(PROMPT, script, set(), 64), SpeculationOptions(k=8))
    sampled_eos = plain_engine.forward_rows([*PROMPT[-1:], *plain[:3]], len(PROMPT) - 1)[3].argmax() == eos
    out = list(spec.generate(PROMPT, 0, 12, GREEDY))
    assert out == plain if not sampled_eos else out == script
    # the end of the context: as plain decoding
    short = CpuEngine(model, seq_len=len(PROMPT) + 4, batch_invariant=True)
    spec = SpeculativeEngine(short, ScriptDrafter(PROMPT, plain, set(), 64), SpeculationOptions(k=8))
    assert list(spec.generate(PROMPT, 0, 12, GREEDY)) == plain[:5]


def test_drafting_turns_itself_off_where_nothing_is_kept(model):
    """Drafts that are never kept, at a pass cost of 1.5 token steps: a few passes, then plain
    token steps with a probe 16, 32, 64 tokens apart; the output is plain decoding's."""
    plain = list(engine(model).generate(PROMPT, 0, 100, GREEDY))
    options = SpeculationOptions(costs=PassCosts.ratio(1.5))
    spec = SpeculativeEngine(engine(model), ScriptDrafter(PROMPT, plain, set(range(100)), 64), options)
    assert list(spec.generate(PROMPT, 0, 100, GREEDY)) == plain
    stats = options.stats
    assert stats.kept == 0
    assert stats.passes <= 10
    assert stats.plain_tokens >= 90


class NothingDrafter:
    """Finds no source: drafts nothing."""

    name = "nothing"

    def source(self, context: list[int]) -> None:
        return None


@pytest.mark.parametrize("found", [False, True, "one"], ids=["no-source", "source-off", "one-source-off"])
def test_plain_stretches(model, found):
    """Where lookups find no source at all, the plain stretches (engine.generate calls) grow
    from PLAIN_RUN (4) to PLAIN_MOST (16); a source found, even one turned off, keeps them at
    PLAIN_RUN, so that it (or a longer match) is looked at again soon; the one source of a
    drafter (a draft model) takes each stretch off in one call. The output is plain
    decoding's."""
    plain = list(engine(model).generate(PROMPT, 0, 60, GREEDY))
    assert len(plain) == 60
    target = engine(model)
    runs: list[int] = []  # each engine.generate call's max_new
    generate = target.generate

    def counted(ids: list[int], pos: int, n: int, sampling: SamplingParams, *args: object) -> object:
        runs.append(n)
        return generate(ids, pos, n, sampling, *args)

    target.generate = counted
    options = SpeculationOptions(costs=PassCosts.ratio(1.5))
    drafter = ScriptDrafter(PROMPT, plain, set(range(60)), 64) if found else NothingDrafter()
    drafter.one_source = found == "one"
    assert list(SpeculativeEngine(target, drafter, options).generate(PROMPT, 0, 60, GREEDY)) == plain
    if not found:
        assert options.stats.passes == 0 and runs == [4, 8, 16, 16, 16]
    elif found is True:  # a few passes keep nothing, then the source is off and probed now and then
        assert 2 <= options.stats.passes <= 5 and options.stats.kept == 0 and max(runs) == 4
    else:  # passes that keep nothing, off for 16 tokens, a probe, off for 32, a probe, the rest
        assert options.stats.passes == 4 and options.stats.kept == 0 and runs == [16, 32, 8]


def test_ngram_loop_is_plain_decoding(model):
    """n-gram lookup on a random model (it falls into loops, where drafts are kept): the output
    is plain decoding's, with passes that kept drafts."""
    plain = list(engine(model).generate(PROMPT, 0, 100, GREEDY))
    options = SpeculationOptions(costs=PassCosts.ratio(1.2))
    spec = SpeculativeEngine(engine(model), NgramDrafter(), options)
    assert list(spec.generate(PROMPT, 0, 100, GREEDY)) == plain
    assert options.stats.kept > 0 and options.stats.passes > 0


def test_measure_costs_times_every_token_it_asks_for(model):
    """measure_costs' plain token steps run to the count they divide by: no EOS ends a timed
    call early (one did on Qwen2.5-Coder-1.5B from token 0, and its token step looked 1.24 ms
    against the 1.9 ms a token that decoding took)."""
    e = engine(model)
    calls, generate = [], e.generate

    def counted(ids, pos, n, sampling, *args, **kw):
        out = list(generate(ids, pos, n, sampling, *args, **kw))
        calls.append((n, len(out), sampling.end_ids(e.config.eos_ids)))
        return iter(out)

    e.generate = counted
    measure_costs(e, 0, rows=(2,), repeats=1)
    assert calls and all(n == got and not eos for n, got, eos in calls)


def test_first_call_measures_the_passes_k_picks_between(model):
    """Without given costs, a speculative engine's first call times a pass of 2, 8 and 16 rows
    (once each after a warm-up: the call's first token waits for them) and plain token steps,
    then keeps those costs; the output is plain decoding's."""
    spec = SpeculativeEngine(engine(model), NgramDrafter())
    assert list(spec.generate(PROMPT, 0, 30, GREEDY)) == list(engine(model).generate(PROMPT, 0, 30, GREEDY))
    costs = spec._adaptive.costs
    assert [n for n, _ in costs.rows] == [2, 8, 16] and costs.step > 0 and all(c > 0 for _, c in costs.rows)
    list(spec.generate(PROMPT, 0, 5, GREEDY))
    assert spec._adaptive.costs is costs


class GpuLike:
    """The attributes speculation_default reads of a GPU engine, over a CPU engine."""

    def __init__(
        self, engine: CpuEngine, use_graph: bool = True, simple: bool = False, multi_token: bool = True
    ) -> None:
        self.engine, self.device, self.use_graph, self.simple = engine, "gpu", use_graph, simple
        self.multi_token = multi_token

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


def test_speculation_is_on_by_default_where_it_pays(model, tmp_path):
    """--speculate auto: n-gram lookup on the GPU engine's captured passes, for greedy calls
    only (a sampled call decodes plainly, its tokens plain sampling's); off on the CPU engine,
    without graphs (the simulator), with the simple kernels and where the multi-token forward
    does not take the model (head_dim 8 here: no rows pass; an explicit choice is refused)."""
    from pycalm.app.models import make_speculative
    from pycalm.app.speculative import speculation_default

    cpu = engine(model)
    assert speculation_default(cpu) == "off"
    assert speculation_default(GpuLike(cpu)) == "ngram"
    assert speculation_default(GpuLike(cpu, use_graph=False)) == "off"
    assert speculation_default(GpuLike(cpu, simple=True)) == "off"
    assert cpu.config.head_dim % 16  # (what the GPU's multi-token forward does not take)
    assert speculation_default(GpuLike(cpu, multi_token=False)) == "off"
    with pytest.raises(PycalmError, match="multi-token forward does not take head_dim"):
        SpeculativeEngine(GpuLike(cpu, multi_token=False), NgramDrafter())
    moe = GpuLike(cpu)
    moe.config = replace(cpu.config, n_experts=8, n_experts_active=2)
    assert speculation_default(moe) == "off"
    kw = dict(draft_model=None, draft_k=None, dtype="fp16", cache=tmp_path, kv="fp16", log=print)
    assert make_speculative(cpu, "auto", **kw) is cpu
    spec = make_speculative(GpuLike(engine(model)), "auto", **kw)
    assert isinstance(spec, SpeculativeEngine) and isinstance(spec.drafter, NgramDrafter)
    spec.options.costs = PassCosts.ratio(1.2)
    sampled = SamplingParams(1.0, seed=3)
    assert list(spec.generate(PROMPT, 0, 40, sampled)) == list(engine(model).generate(PROMPT, 0, 40, sampled))
    assert spec.stats.passes == 0
    assert list(spec.generate(PROMPT, 0, 100, GREEDY)) == list(engine(model).generate(PROMPT, 0, 100, GREEDY))
    assert spec.stats.passes > 0 and spec.stats.kept > 0  # (a random model falls into loops)
    explicit = make_speculative(GpuLike(engine(model)), "ngram", **kw)
    assert explicit.options.greedy_only is False


class SamplingDrafter:
    """Drafts 3 tokens, each drawn from a fixed distribution q of its own (not one-hot)."""

    name = "q"

    def __init__(self, q: np.ndarray, seed: int) -> None:
        self.q, self.rng = q, np.random.default_rng(seed)

    def source(self, context: list[int]) -> str:
        return "q"

    def propose(self, context: list[int], k: int) -> Draft:
        tokens = [int(t) for t in self.rng.choice(len(self.q), k, p=self.q)]
        return Draft(tokens, np.tile(self.q, (k, 1)))


def test_sampled_drafts_keep_the_target_distribution_through_the_loop(model):
    """A drafter with its own q (far from the model's p) through the loop: over 1,500 seeds the
    first two tokens follow the model's distribution (chi-square below the 1e-4 critical value
    for the first token, and for the second token's marginal, computed exactly)."""
    sampling = SamplingParams(1.0, top_k=5)
    base = engine(model)
    base.prefill(PROMPT[:-1], 0)
    p0 = target_distribution_ref(base.logits(PROMPT[-1], len(PROMPT) - 1), 1.0, 5)
    p1 = np.zeros(64)
    for a in np.flatnonzero(p0):
        p1 += p0[a] * target_distribution_ref(base.logits(int(a), len(PROMPT)), 1.0, 5)
    q = np.full(64, 0.2 / 64)
    q[np.flatnonzero(p0)] += 0.8 * np.array([0.6, 0.1, 0.1, 0.1, 0.1])  # mis-weighted on p0's tokens
    spec = SpeculativeEngine(engine(model), SamplingDrafter(q, 1), SpeculationOptions(k=3))
    list(spec.generate(PROMPT, 0, 0, GREEDY))  # the prompt cached once; each run feeds its last token
    first, second = np.zeros(64), np.zeros(64)
    for seed in range(1500):
        s = SamplingParams(sampling.temperature, sampling.top_k, seed=seed)
        a, b = spec.generate([PROMPT[-1]], len(PROMPT) - 1, 2, s)
        first[a] += 1
        second[b] += 1
    for counts, p in ((first, p0), (second, p1)):
        live = p > 0
        assert counts[~live].sum() == 0
        assert chi_square(counts[live], p[live]) < CHI2_CRITICAL.get(int(live.sum()) - 1, 40.0)
    assert spec.stats.kept > 0 and spec.stats.kept < spec.stats.drafted  # the rule did both


def test_needs_a_rows_pass():
    with pytest.raises(PycalmError, match="forward_rows"):
        SpeculativeEngine(object(), NgramDrafter())


# ---------------------------------------------------------------------------------------------
# the draft-model drafter


@pytest.mark.parametrize("same", [True, False], ids=["itself", "another"])
def test_draft_model_keeps_its_cache_in_step(model, tmp_path, same):
    """The model drafting for itself: every draft kept (its cache follows the text, the last
    draft of a fully kept pass fed before the next); another random model of the same
    vocabulary: drafts kept and replaced. Both: plain decoding's output, over two calls."""
    from pycalm.app.speculative import ModelDrafter

    if same:
        draft_model = model
    else:
        hf = make_hf_llama(tmp_path, arch="llama", vocab_size=64, seed=3)
        draft_model = open_model(convert(hf.path, tmp_path / "d.pycalm", "fp16", progress=False))
    plain_engine = engine(model)
    drafter = ModelDrafter(engine(draft_model), model.config)
    options = SpeculationOptions(k=3)
    spec = SpeculativeEngine(engine(model), drafter, options)
    plain = list(plain_engine.generate(PROMPT, 0, 20, GREEDY))
    assert list(spec.generate(PROMPT, 0, 20, GREEDY)) == plain
    turn = [plain[-1], 7, 8, 9]  # the next turn, from after the reply
    pos = len(PROMPT) + len(plain) - 1
    assert list(spec.generate(turn, pos, 12, GREEDY)) == list(plain_engine.generate(turn, pos, 12, GREEDY))
    if same:
        assert options.stats.kept == options.stats.drafted
    else:
        assert options.stats.kept < options.stats.drafted


class CountingEngine:
    """An engine that records how its cache is fed outside token steps: prefills, rows passes."""

    def __init__(self, engine: CpuEngine) -> None:
        self.engine, self.prefills, self.rows = engine, [], 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def prefill(self, ids: list[int], start_pos: int) -> None:
        self.prefills.append((list(ids), start_pos))
        self.engine.prefill(ids, start_pos)

    def forward_rows(self, *args: object) -> object:
        self.rows += 1
        return self.engine.forward_rows(*args)


def test_draft_model_takes_the_prompt_with_the_target_and_steps_after_a_kept_pass(model):
    """The prompt goes into the draft model's cache with the target's prefill (SpeculativeEngine
    .prefill, and generate's own), not by its first drafting; after a pass that kept every draft,
    the last draft goes in by one more token step (no rows pass). Drafting for itself, k = 3."""
    from pycalm.app.speculative import ModelDrafter

    draft = CountingEngine(engine(model))
    options = SpeculationOptions(k=3)
    spec = SpeculativeEngine(engine(model), ModelDrafter(draft, model.config), options)
    spec.prefill(PROMPT[:-1], 0)
    assert draft.prefills == [(PROMPT[:-1], 0)]
    out = list(spec.generate(PROMPT[-1:], len(PROMPT) - 1, 12, GREEDY))
    assert out == list(engine(model).generate(PROMPT, 0, 12, GREEDY))
    assert draft.prefills == [(PROMPT[:-1], 0)] and draft.rows == 0
    # 3 passes of 4 tokens, every draft kept (the drafts right: the catch-up went in at its place)
    assert options.stats.passes == 3 and options.stats.kept == options.stats.drafted == 9
    spec2 = SpeculativeEngine(
        engine(model), ModelDrafter(draft := CountingEngine(engine(model)), model.config)
    )
    list(spec2.generate(PROMPT, 0, 4, GREEDY))
    assert draft.prefills == [(PROMPT[:-1], 0)]


def test_a_pass_after_a_draft_models_catch_up_does_not_time_the_model(model, monkeypatch):
    """A draft model whose cache lacks text before drafting (a probe after a stretch off) feeds it
    first (Draft.caught_up); on the GPU that catch-up is enqueued and its time falls in the
    pass's, so the loop gives AdaptiveK no wall time for that pass, and every other pass's."""
    from pycalm.app.speculative import ModelDrafter

    drafter = ModelDrafter(engine(model), model.config)
    first = drafter.propose(PROMPT, 3)  # its cache empty: the prompt but the last token caught up
    assert first.caught_up
    kept = first.tokens[:1]
    assert not drafter.propose([*PROMPT, *kept], 3).caught_up  # fed by its own steps
    measured = replace(PassCosts.ratio(1.5, 0.1), measured=True)
    spec = SpeculativeEngine(engine(model), drafter, SpeculationOptions(costs=measured))
    seen = []
    update = AdaptiveK.update
    monkeypatch.setattr(AdaptiveK, "update", lambda self, *a: (seen.append(a[-1]), update(self, *a))[1])
    spec.prefill(PROMPT[:-1], 0)
    drafter.forget()  # its cache lost: the call's first pass catches up
    list(spec.generate(PROMPT[-1:], len(PROMPT) - 1, 12, GREEDY))
    assert len(seen) > 1 and seen[0] is None and all(t is not None and t > 0 for t in seen[1:])


def test_a_draft_model_on_the_gpu_feeds_its_last_draft_beside_the_pass(model):
    """A draft model on the GPU (the simulator here) drafting for a target of its own weights:
    its step that feeds the last draft runs after the drafts' event (beside the pass), so after
    a pass that kept every draft its cache holds them all and the next drafts follow at once,
    as many steps as drafts; the output is plain greedy decoding's, every draft kept."""
    from pycalm.app.speculative import ModelDrafter
    from pycalm.gpu.engine import GpuEngine

    gpu = GpuEngine(model, seq_len=64, kv_dtype="fp16")
    fed = []
    greedy_tokens = gpu.greedy_tokens
    gpu.greedy_tokens = lambda ids, pos, n, **o: (fed.append(len(ids)), greedy_tokens(ids, pos, n, **o))[1]
    options = SpeculationOptions(k=2)
    spec = SpeculativeEngine(engine(model), ModelDrafter(gpu, model.config), options)
    out = list(spec.generate(PROMPT[:1], 0, 6, GREEDY))  # (no prompt pass: the simulator's are slow)
    assert out == list(engine(model).generate(PROMPT[:1], 0, 6, GREEDY))
    assert options.stats.passes == 2 and options.stats.kept == options.stats.drafted == 4
    assert fed == [1, 1]  # the last token alone: each pass's drafts were all in its cache


def test_a_draft_models_pass_costs_its_call_and_the_catch_up_step():
    """speedup with a draft model: k drafts cost k steps, the call's fixed cost, and (where all
    k are kept, rate^k) the step that feeds the last draft before the next pass."""
    costs = PassCosts(1.0, ((8, 1.4),), draft_step=0.3, draft_call=0.2)
    rate, k = 0.8, 5
    expected = sum(rate**i for i in range(k + 1))
    assert costs.speedup(k, rate) == pytest.approx(expected / (1.4 + (k + rate**k) * 0.3 + 0.2))
    assert PassCosts(1.0, ((8, 1.4),), draft_call=0.2).speedup(k, rate) == pytest.approx(expected / 1.4)
    # the step that feeds the last draft beside the pass (a draft model on the GPU) costs its feed_last
    beside = PassCosts(1.0, ((8, 1.4),), draft_step=0.3, draft_call=0.2, feed_last=0.0)
    assert beside.speedup(k, rate) == pytest.approx(expected / (1.4 + k * 0.3 + 0.2))


def test_a_draft_model_starts_on_and_its_pass_is_timed_whole(model):
    """A draft model's source starts from its own prior (0.9: drafting pays from the first pass
    at costs like the GPU's, where PRIOR's 0.5 turns it off before any pass), and measure_costs
    times one whole pass of drafts (k = 7 for rows up to 8), draft_call being what it takes
    beyond its draft steps and its rows pass."""
    from pycalm.app.speculative import ModelDrafter

    adaptive = AdaptiveK(PassCosts(1.0, ((16, 1.4),), draft_step=0.25, draft_call=0.1))
    assert adaptive.plan("model", 0, ModelDrafter.PRIOR) == 8
    assert adaptive.plan("other", 0, PRIOR) == 0
    drafter = ModelDrafter(engine(model), model.config)
    timed = []
    whole = drafter.draft
    drafter.draft = lambda fed, pos, k: (timed.append(k), whole(fed, pos, k))[1]
    costs = measure_costs(engine(model), 0, drafter, rows=(2, 8), repeats=1)
    assert set(timed) == {7} and costs.draft_step > 0 and costs.draft_call >= 0
    assert costs.feed_last is None  # (a CPU draft engine feeds its last draft by a step of its own)
    assert costs.measured and not PassCosts.ratio(1.2).measured  # (seconds of the engine: AdaptiveK online)
    assert [n for n, _ in costs.rows] == [2, 8]


def test_drafts_on_the_gpu_reach_a_target_without_its_rows_pass_by_the_host(model):
    """check_drafts with drafts still on the GPU (Draft.device) and a target that has no device
    path (the CPU engine): it waits for their event, reads their pinned copy and checks them as
    host drafts, each row sampling what a pass given the same ids samples."""
    from pycalm.app.speculative import check_drafts
    from pycalm.gpu.engine import DeviceTokens

    class Event:
        waited = False

        def synchronize(self) -> None:
            self.waited = True

    drafts, coins = [9, 11, 5], np.array([0.1, 0.6, 0.3, 0.9])
    event = Event()
    draft = Draft([], device=DeviceTokens(None, np.array(drafts, np.int32), event))
    sampled = check_drafts(engine(model), PROMPT[-1], len(PROMPT) - 1, draft, GREEDY, coins)
    want = engine(model).forward_rows([PROMPT[-1], *drafts], len(PROMPT) - 1, [GREEDY] * 4, coins)
    assert event.waited and draft.tokens == drafts and list(sampled) == list(want)


def test_draft_model_catches_up_by_passes_of_64_rows(model, monkeypatch):
    """Text the draft model did not draft for (the plain stretches of a source turned off) goes
    into its cache in prompts of up to 64 tokens (one rows pass each on the GPU), up to
    CATCH_UP_PASSES of them; more in one prompt."""
    from pycalm.app import speculative
    from pycalm.app.speculative import ModelDrafter

    text = [int(t) for t in np.random.default_rng(3).integers(0, 64, 200)]
    draft = CountingEngine(CpuEngine(model, seq_len=256))
    drafter = ModelDrafter(draft, model.config)
    drafts = drafter.propose(text[:150], 2).tokens  # 149 tokens fed: prompts of 64, 64, 21
    assert draft.prefills == [(text[:64], 0), (text[64:128], 64), (text[128:149], 128)] and draft.rows == 0
    monkeypatch.setattr(speculative, "CATCH_UP_PASSES", 2)
    draft = CountingEngine(CpuEngine(model, seq_len=256))
    assert ModelDrafter(draft, model.config).propose(text[:150], 2).tokens == drafts
    assert draft.rows == 0 and draft.prefills == [(text[:149], 0)]


def test_draft_model_needs_the_same_vocabulary(model, tmp_path):
    from pycalm.app.speculative import ModelDrafter

    hf = make_hf_llama(tmp_path, arch="llama", vocab_size=80)
    other = open_model(convert(hf.path, tmp_path / "v.pycalm", "fp16", progress=False))
    with pytest.raises(PycalmError, match="vocabulary"):
        ModelDrafter(engine(other), model.config)


# ---------------------------------------------------------------------------------------------
# the GPU engine (a rows pass under the simulator takes seconds: GPU only)


@gpu_only("simulator time: a rows pass with sample_rows takes seconds a row there")
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_gpu_speculative_output_is_plain_decodings(tmp_path, batch_invariant):
    """On the GPU engine: with batch_invariant, greedy and sampled speculation (drafts kept and
    replaced, n-gram lookup with measured costs, and greedy: the model drafting for itself, its
    drafts going into the pass on the device) give plain decoding's tokens, and leave the
    token step's state at the last token and its position; without it, the tokens part from
    plain decoding's at most at a near tie (counted, and the first must follow one)."""
    from pycalm.app.speculative import ModelDrafter
    from pycalm.gpu.engine import EngineOptions, GpuEngine
    from pycalm.kernels.common import STATE_POS, STATE_TOKEN

    hf = make_hf_llama(tmp_path, arch="qwen2", dim=256, hidden_dim=512, n_layers=4, n_heads=8, n_kv_heads=2,
                       vocab_size=512)  # fmt: skip
    gpu_model = open_model(convert(hf.path, tmp_path / "g.pycalm", "fp16", progress=False))
    options = EngineOptions(batch_invariant=batch_invariant)
    plain_engine = GpuEngine(gpu_model, seq_len=256, options=options)
    e = GpuEngine(gpu_model, seq_len=256, options=options)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 512, 40)]
    for sampling in (GREEDY, SamplingParams(0.8, top_p=0.9, seed=11)):
        plain = list(plain_engine.generate(prompt, 0, 48, sampling))
        drafters = [(ScriptDrafter(prompt, plain, {2, 5, 6, 20}, 512), 4), (NgramDrafter(), None)]
        if sampling == GREEDY:  # the model drafting for itself on the GPU: its drafts stay there
            drafters.append((ModelDrafter(GpuEngine(gpu_model, seq_len=256, options=options), e.config), 5))
        for drafter, k in drafters:
            costs = measure_costs(e, 0) if k is None else None
            spec = SpeculativeEngine(e, drafter, SpeculationOptions(k=k, costs=costs))
            out = list(spec.generate(prompt, 0, 48, sampling))
            if batch_invariant:
                assert out == plain
                if isinstance(drafter, ModelDrafter):  # every draft kept, but past the last token
                    assert spec.stats.kept >= spec.stats.drafted - k
                state = e.state.copy_to_host()
                assert (state[STATE_TOKEN], state[STATE_POS]) == (out[-1], len(prompt) + len(out) - 1)
            elif out != plain and sampling == GREEDY:
                at = next(i for i, (a, b) in enumerate(zip(out, plain, strict=False)) if a != b)
                logits = list(plain_engine.prefill_logits([*prompt, *plain[:at]], 0))[-1]
                top = np.sort(logits[-1])[-2:]
                assert top[1] - top[0] < 1e-2 * abs(top[1]), (at, top)


# ---------------------------------------------------------------------------------------------
# a real model (e2e, slow)


def test_real_model_ngram_is_plain_greedy(smollm2_fp16):
    """SmolLM2 continuing a repeating list, through pycalm.load(speculate="ngram", draft_k=4) on
    the CPU engine with batch_invariant: plain greedy decoding's tokens, with drafts kept."""
    import pycalm

    options = dict(device="cpu", context=256, verbose=False, batch_invariant=True)
    plain = pycalm.load(smollm2_fp16, **options)
    spec = pycalm.load(smollm2_fp16, **options, speculate="ngram", draft_k=4)
    ids = plain.tokenize("red apple, green pear, blue plum, red apple, green pear, blue plum, red")
    want = list(plain.engine.generate(ids, 0, 20, GREEDY))
    assert list(spec.engine.generate(ids, 0, 20, GREEDY)) == want
    stats = spec.engine.stats
    assert stats.kept >= 8, (plain.tokenizer.decode(want), stats)  # the loop goes on: drafts kept
