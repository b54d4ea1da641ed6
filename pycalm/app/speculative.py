"""Speculative decoding: several tokens a pass of the target model, for one sequence.

A drafter proposes the next k tokens cheaply; one pass of the target over k + 1 rows (the last
kept token and the k drafts, engine.forward_rows) gives the target's choice after each of them.
The drafts it agrees with are kept up to the first it does not, and the target's own token
there (or after the last draft) comes with them: 1 to k + 1 tokens for one read of the weights.

    engine = SpeculativeEngine(engine, NgramDrafter())      # engine.generate's contract
    for token in engine.generate(ids, start_pos, max_new, sampling): ...

The KV cache. It is indexed by position: the pass writes rows pos .. pos + k, and the rows past
the last kept token are rewritten by the next pass before any row reads them (a row attends to
positions up to its own). Rolling back past a rejected draft is starting the next pass at the
kept position. A draft model keeps its own cache the same way (ModelDrafter).

Exactness. The drafters here are deterministic (n-gram lookup; a draft model decoding
greedily), so their distribution q is one-hot on the draft, and the rejection rule
(pycalm.cpu.reference.speculative_accept_ref: keep x with probability min(1, p(x) / q(x)), else
draw from max(0, p - q)) becomes: draw y from the target's p with the plain sampler's coin, keep
the draft when y == x. Every row of the pass samples on the device (sample_rows), so only k + 1
token ids come back. The coin of the j-th token of a call is the j-th of the seed's sequence, as
the plain sampler's: a row's coin decides the token of its position only when every draft before
it was kept, so the coins stay independent of what they decide. Where every pass gives a row the
bits that plain decoding gives its token (batch_invariant engines), the output is plain
decoding's, token for token, greedy or sampled (sampled on the GPU: up to the float32 walk of
sample_rows against the float64 host sampler at a coin's boundary). Without batch_invariant, the
pass's logits differ from the token step's by about 1e-3 relative, so the two can part at near
ties. A drafter that gives its q (Draft.q) is checked on the host by verify_ref instead.

When it pays. A pass of n rows costs c(n) against a plain token step s (PassCosts: measured once
on the engine, or given); a draft token costs d (a draft model's step; 0 for n-gram lookup). With
each draft kept with probability a (AdaptiveK: the drafts kept over the drafts checked, up to
and with the first one replaced, summed over the recent passes, the last few counting most, so
a stretch of copied text turns it on and free text off; a pass's own ratio, averaged, would
underrate a: at a = 0.9 and k = 7 its mean is 0.78), k drafts give E(k) = 1 + a + ... + a^k
tokens a pass, so speculation runs E(k) s / (c(k + 1) + k d) times plain decoding's speed
(PassCosts.speedup, with what the measured passes add: AdaptiveK online). AdaptiveK takes the
k that maximises it; where no k reaches 1, drafting from that source (an n-gram length, the draft model) stops for
16 tokens (doubling to 256 while it keeps failing), then one pass probes it again. A source not
seen yet starts from its drafter's prior. Tokens where no draft is proposed go through
engine.generate, the plain token steps, PLAIN_RUN (4) at a time, so that a source that comes up
(a longer match, or one whose stretch off is over) is taken soon; where the lookups find no
source at all the stretches double up to PLAIN_MOST (16). A draft model, the one source of its
drafter, takes its stretch off in one call.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from pycalm.cpu.reference import target_distribution_ref, verify_ref
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError

ROWS_MOST = 64  # rows a pass takes at most (the GPU's largest captured row bucket)
K_MOST = 8  # drafts a pass checks at most, by default
PLAIN_RUN = 4  # plain tokens generated where no draft is proposed, before looking again
PLAIN_MOST = 16  # a stretch doubles up to this while the lookups find no source at all
RETRY_FIRST, RETRY_MOST = 16, 256  # plain tokens before a failing source is probed again
DECAY = 0.7  # the weight of the drafts seen before a pass (about the last 3 passes count)
PRIOR = 0.5  # a new source's acceptance, until passes are seen (a drafter may give its own)
PRIOR_DRAFTS = 4  # the drafts' worth of evidence that a prior counts for
OVERHEAD_DECAY = 0.7  # the weight of the overhead measured before a pass (AdaptiveK online)
OVERHEAD_STEP = 0.25  # a pass's excess counts at most this much of its modelled time from the average
GREEDY = SamplingParams()
NO_EOS = SamplingParams(ignore_eos=True)  # greedy, every token asked for (the token steps are GREEDY's)
MEASURE_ROWS = (2, 4, 8, 16)  # the passes measure_costs times (k up to 15)
FIRST_CALL_ROWS = (2, 8, 16)  # ... where a call's first token waits for them (k 1 / 2-7 / 8-15)
CATCH_UP_PASSES = 4  # a draft model's catch-up of up to this many rows passes goes in pieces that fit one
SPECULATE = ("auto", "off", "ngram", "draft")  # the --speculate choices (auto: speculation_default)


@dataclass(frozen=True)
class PassCosts:
    """Seconds of a plain token step and of a pass of n rows, and of a draft token."""

    step: float  # a token of plain decoding (engine.generate, graph replays in flight)
    rows: tuple[tuple[int, float], ...]  # (n, seconds of a pass of n rows), n ascending
    draft_step: float = 0.0  # a drafted token (a draft model's step; 0 for n-gram lookup)
    # a draft model's pass beyond its k steps and its rows pass: the two engines' calls and the
    # host between them (measure_costs: a whole pass of drafts, less its parts)
    draft_call: float = 0.0
    # the step that feeds the last draft after a pass that kept them all: None, a draft step
    # before the next pass's drafts; 0.0 where it runs beside the pass (a draft model on the GPU,
    # ModelDrafter.draft: then what it slows the pass by is in draft_call)
    feed_last: float | None = None
    measured: bool = False  # seconds of this engine (measure_costs), not configured ratios

    @classmethod
    def ratio(cls, pass_cost: float, draft_cost: float = 0.0) -> PassCosts:
        """Configured costs: any pass of up to ROWS_MOST rows costs pass_cost token steps, a
        drafted token draft_cost."""
        return cls(1.0, ((ROWS_MOST, float(pass_cost)),), float(draft_cost))

    def pass_cost(self, n: int) -> float:
        """Seconds of a pass of n rows: the measured pass of the fewest rows >= n."""
        costs = self._pass_costs
        return costs[n] if n < len(costs) else self.rows[-1][1]

    @functools.cached_property
    def _pass_costs(self) -> tuple[float, ...]:
        """pass_cost(n) for n = 0 .. ROWS_MOST, looked up (it is asked k_most times a plan)."""
        return tuple(
            next((s for m, s in self.rows if m >= n), self.rows[-1][1]) for n in range(ROWS_MOST + 1)
        )

    def pass_time(self, k: int, rate: float) -> float:
        """Seconds of a pass of k drafts, each kept with probability `rate`: c(k + 1) + k d +
        rate^k f + d0; a draft model's pass takes its call's d0, and where every draft was kept
        (rate^k) the step f that feeds the last draft (feed_last; d where it is not given)."""
        feed_last = self.draft_step if self.feed_last is None else self.feed_last
        drafting = k * self.draft_step + rate**k * feed_last + self.draft_call if self.draft_step else 0.0
        return self.pass_cost(k + 1) + drafting

    def speedup(self, k: int, rate: float, overhead: float = 0.0) -> float:
        """Plain decoding's time over speculation's: E(k) s / (pass_time(k, rate) + overhead),
        E(k) = 1 + rate + ... + rate^k; overhead: seconds a pass takes beyond the model
        (AdaptiveK's, measured on the passes of the calls), which never makes a pass cost less
        than half its model."""
        return self.speedups(k, rate, overhead)[-1]

    def speedups(self, k_most: int, rate: float, overhead: float = 0.0) -> list[float]:
        """speedup(k, rate, overhead) for k = 1 .. k_most, in one walk (AdaptiveK asks for them
        all twice a pass, between the pass's result and the next drafts' launch)."""
        out, expected = [], 1.0
        for k in range(1, k_most + 1):
            expected += rate**k  # E(k), added in the order of sum(rate**i for i in range(k + 1))
            modelled = self.pass_time(k, rate)
            out.append(expected * self.step / max(modelled + overhead, 0.5 * modelled))
        return out


def measure_costs(
    engine: object,
    pos: int,
    drafter: object = None,
    rows: tuple[int, ...] = MEASURE_ROWS,
    repeats: int = 3,
    tokens: int = 8,
) -> PassCosts:
    """PassCosts of `engine` at position pos (the best of `repeats` timings each, after a
    warm-up that compiles and captures): `tokens` plain tokens through engine.generate, and a
    pass of each row count in `rows`; with a ModelDrafter, its engine's plain token, and a whole
    pass of k drafts (k + 1 the largest of `rows` up to K_MOST + 1: drafting and checking them as
    the loop does), whose time beyond its draft steps and its rows pass is draft_call. Writes
    cache rows pos .. pos + max(tokens, rows): call it where those hold nothing yet."""
    n = min(tokens, engine.seq_len - pos - 1)
    if n < 1:
        raise PycalmError(f"no room to time a pass at position {pos} of {engine.seq_len}")

    def best(run: object) -> float:
        run()  # warm-up: compiles, captures
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return min(times)

    def plain(e: object, n: int = n) -> float:  # (n tokens: an EOS does not end the call early)
        return best(lambda: list(e.generate([0], pos, n, NO_EOS))) / n

    def rows_pass(e: object, m: int) -> float:
        return best(lambda: e.forward_rows([0] * m, pos, [GREEDY] * m, np.zeros(m)))

    costs = PassCosts(
        plain(engine),
        tuple((m, rows_pass(engine, m)) for m in rows if pos + m <= engine.seq_len),
        measured=True,
    )
    if isinstance(drafter, ModelDrafter):
        d = drafter.engine
        draft_step = plain(d)
        k = (
            max((m for m in rows if m <= K_MOST + 1 and pos + m <= min(engine.seq_len, d.seq_len)), default=2)
            - 1
        )
        whole = best(
            lambda: check_drafts(engine, 0, pos, drafter.draft([0], pos, k), GREEDY, np.zeros(k + 1))
        )
        beside = drafter.on_device  # its step that feeds the last draft runs beside the pass
        costs = replace(
            costs,
            draft_step=draft_step,
            draft_call=max(whole - costs.pass_cost(k + 1) - k * draft_step, 0.0),
            feed_last=0.0 if beside else None,
        )
        if beside:  # on the GPU: the row buckets of its catch-ups (prefill's cache_only passes),
            for m in (2**i for i in range(ROWS_MOST.bit_length())):  # compiled and captured before they count
                if pos + m <= d.seq_len:
                    d.forward_rows([0] * m, pos, cache_only=True)
        drafter.forget()  # its cache rows past pos were scribbled on
    return costs


# -------------------------------------------------------------------------------------------
# adaptive k


@dataclass
class Source:
    """The recent acceptance of one source of drafts, and when it is tried next."""

    # the drafts kept and checked (up to and with the first replaced), each pass's weighing DECAY
    # once a pass is seen after it; at first the prior's PRIOR_DRAFTS drafts
    kept: float = PRIOR * PRIOR_DRAFTS
    checked: float = PRIOR_DRAFTS
    off_until: int = 0  # tokens of the call before which this source drafts nothing
    backoff: int = RETRY_FIRST  # the next stretch it stays off for
    probing: bool = False  # off and past off_until: the next pass is a probe

    @classmethod
    def from_prior(cls, prior: float) -> Source:
        return cls(kept=prior * PRIOR_DRAFTS)

    @property
    def rate(self) -> float:
        """The chance that a draft is kept: kept / checked."""
        return self.kept / self.checked


class AdaptiveK:
    """The drafts a pass checks, from each source's recent acceptance and the pass costs (the
    module docstring). fixed_k: always that many (no adaptation, no switching off).

    online (costs measured in seconds on this engine, PassCosts.measured): each pass's wall
    time, given to update, corrects the model by `overhead`, the seconds a pass takes beyond
    pass_time (the host between the engines' calls, a draft step beside the pass slowing it):
    an average of the recent passes' excess, each counted at most OVERHEAD_STEP of its
    modelled time from the average so far, so that a pass that captured a graph (tens of ms,
    once) moves it little."""

    def __init__(
        self, costs: PassCosts | None, k_most: int = K_MOST, fixed_k: int | None = None, online: bool = False
    ) -> None:
        if fixed_k is None and costs is None:
            raise PycalmError("adaptive k needs the pass costs (measured or configured)")
        if not 1 <= (fixed_k or k_most) < ROWS_MOST:
            raise PycalmError(f"k must be 1 to {ROWS_MOST - 1}, not {fixed_k or k_most}")
        self.costs, self.k_most, self.fixed_k, self.online = costs, k_most, fixed_k, online
        self.sources: dict[object, Source] = {}
        self.overhead = 0.0  # seconds a pass beyond costs.pass_time (online)
        self._best: tuple = (None, None)  # ((rate, overhead), best's answer) of the last call

    def best(self, rate: float) -> tuple[int, float]:
        """(k, its speedup) of the k in 1 .. k_most that maximises the speedup at `rate` (the
        smallest such k on ties)."""
        if self._best[0] != (rate, self.overhead):  # (update asks, then the next plan, at one rate)
            gains = self.costs.speedups(self.k_most, rate, self.overhead)
            gain = max(gains)
            self._best = ((rate, self.overhead), (gains.index(gain) + 1, gain))
        return self._best[1]

    def plan(self, key: object, produced: int, prior: float = PRIOR) -> int:
        """The drafts to take from source `key` now, `produced` tokens generated so far (over
        every call; 0: none, while it is off until off_until(key)); prior: the acceptance of a
        source not seen yet."""
        if self.fixed_k is not None:
            return self.fixed_k
        s = self.sources.setdefault(key, Source.from_prior(prior))
        if produced < s.off_until:
            return 0
        k, gain = self.best(s.rate)
        if gain >= 1.0 or s.probing:  # pays, or a probe after a stretch off
            s.probing = False
            return k
        s.off_until, s.backoff, s.probing = produced + s.backoff, min(2 * s.backoff, RETRY_MOST), True
        return 0

    def off_until(self, key: object) -> int:
        return self.sources[key].off_until if key in self.sources else 0

    def update(
        self, key: object, drafted: int, kept: int, decay: float = DECAY, seconds: float | None = None
    ) -> None:
        """After a pass that kept `kept` of `drafted` drafts from source `key`; decay: the weight
        of the passes before it (a drafter's DECAY); seconds: its wall time (online)."""
        if self.fixed_k is not None:
            return
        s = self.sources.setdefault(key, Source())
        if self.online and seconds is not None and drafted:
            modelled = self.costs.pass_time(drafted, s.rate)
            step = OVERHEAD_STEP * modelled  # (the most one pass moves it, either way)
            excess = min(max(seconds - modelled, self.overhead - step), self.overhead + step)
            self.overhead = OVERHEAD_DECAY * self.overhead + (1 - OVERHEAD_DECAY) * excess
        s.kept = decay * s.kept + kept
        s.checked = decay * s.checked + kept + (kept < drafted)  # the drafts up to the first one replaced
        if self.best(s.rate)[1] >= 1.0:
            s.backoff = RETRY_FIRST


# -------------------------------------------------------------------------------------------
# drafters


@dataclass
class Draft:
    """Proposed tokens, and (for a drafter that samples) their distributions (k, vocab_size);
    None: one-hot on the tokens (a deterministic drafter). device: the tokens still being made
    on the GPU (a draft model there: pycalm.gpu.engine.DeviceTokens), for the target's pass to
    take there; `tokens` is filled once the pass has read them."""

    tokens: list[int]
    q: np.ndarray | None = None
    device: object = None
    # the drafter fed text its cache lacked before drafting (a draft model after a stretch off):
    # on the GPU that catch-up is enqueued, not waited for, so its time falls in the pass's
    caught_up: bool = False

    def __len__(self) -> int:
        return len(self.tokens) if self.device is None else len(self.device.host)

    def take(self) -> list[int]:
        """The tokens, read from the GPU's pinned copy once its event has passed where they
        were still there."""
        if self.device is not None and not self.tokens:
            self.device.event.synchronize()
            self.tokens = [int(t) for t in self.device.host]
        return self.tokens


class NgramDrafter:
    """Prompt lookup: the last n tokens (n from n_most down to n_least) matched against their
    latest earlier occurrence in the prompt and the text so far; the tokens that followed it are
    the drafts. A match that runs into the end of the text repeats the stretch since it (a loop
    in the text is proposed to go on). Its sources are the match lengths n: a 3-token match is
    kept more often than a 1-token one, and AdaptiveK tracks each apart, from PRIORS[n] until
    its passes are seen."""

    name = "ngram"
    # a draft's chance to be kept after an n-token match, before any pass of that n is seen:
    # Qwen2.5-Coder-0.5B's passes at k = 8 over tests/data/speculative_prompts.json (greedy, 160
    # tokens a prompt) kept no draft after 67-76% of its 1-token matches, and 6.5 (grounded) or
    # 2.7 (chat, code) drafts a pass after its 3-token matches. With PRIOR for every n, one
    # rejected 3-token match turned that length off for 16 tokens of a text it then copied.
    PRIORS = {1: 0.3, 2: 0.5, 3: 0.7}

    def prior(self, key: int) -> float:
        return self.PRIORS.get(key, PRIOR)

    def __init__(self, n_most: int = 3, n_least: int = 1) -> None:
        if not 1 <= n_least <= n_most:
            raise PycalmError(f"n-gram lengths {n_least}..{n_most}")
        self.lengths = range(n_most, n_least - 1, -1)
        self._tokens: list[int] = []
        # n -> {the n tokens: the index of the token that followed their latest occurrence}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.lengths}
        self._match = 0  # source()'s find: the index of the token after the matched n-gram

    def _sync(self, context: list[int]) -> None:
        """The index over `context`: extended by its new tokens, or built anew where the text
        before them changed."""
        known = len(self._tokens)
        if len(context) < known or context[:known] != self._tokens:
            self._tokens, known = [], 0
            self._index = {n: {} for n in self.lengths}
        for i in range(known, len(context)):  # the n-grams that end just before token i
            self._tokens.append(context[i])
            for n, index in self._index.items():
                if i >= n:
                    index[tuple(self._tokens[i - n : i])] = i

    def source(self, context: list[int]) -> int | None:
        """The longest n with an earlier occurrence of the last n tokens (None: no match)."""
        self._sync(context)
        end = len(self._tokens)
        for n in self.lengths:
            if end >= n:
                found = self._index[n].get(tuple(self._tokens[end - n :]))
                if found is not None:
                    self._match = found
                    return n
        return None

    def propose(self, context: list[int], k: int) -> Draft:
        """k tokens after the match source() found in the same context."""
        out: list[int] = []
        end = len(self._tokens)
        for j in range(k):  # past the end, the text so far is read on into the drafts
            i = self._match + j
            out.append(self._tokens[i] if i < end else out[i - end])
        return Draft(out)


class ModelDrafter:
    """A draft model with the target's vocabulary: its own engine and KV cache, k greedy tokens
    by its own token steps (engine.generate: on the GPU its captured graphs). Its cache follows
    the text by position: before drafting, the tokens of the text that its cache does not hold
    yet (the target's last token; after a pass that kept every draft, the last draft too) are
    fed, and its cache holds the text and the drafts but the last after. On the GPU the drafts
    stay there (engine.greedy_tokens): the target's pass copies them into its inputs once they
    are written, so the host waits once a pass, for the pass (H100, Qwen2.5-Coder 0.5B for
    1.5B shapes: it waited 0.23 ms for the drafts before launching the pass, of 9.1); and one
    more step, beside the pass, feeds the last draft, so a pass that keeps them all is followed
    by k draft steps, not k + 1 (on code, about half the passes at k = 7)."""

    name = "draft"
    one_source = True  # the same source at every token: a stretch off goes in one call
    # a draft's chance to be kept before any pass is seen: Qwen2.5-Coder-0.5B drafting for the
    # 1.5B kept about 0.7 (chat), 0.83 (grounded) and 0.9 (code) of its drafts (E at k = 4 and 6,
    # docs/BENCHMARKS.md). At the H100's costs (a token step 1.75 ms, the 8-row pass 1.43-1.53
    # steps, a draft step 0.41) drafting pays from about 0.75-0.8: from 0.9 it starts on, and a
    # text it drafts worse for turns it off after a few passes (PRIOR_DRAFTS: the prior counts
    # for 4 drafts).
    PRIOR = 0.9
    # its acceptance changes slowly along a text (n-gram lookup's comes and goes with the copied
    # stretches): about the last 10 passes count. At 0.7 (3 passes) a draft kept 0.85-0.9 of the
    # time turned itself off on runs of early rejections: simulated at the H100's costs, 1.05x /
    # 1.26x against the best fixed k's 1.21x / 1.35x (0.9: 1.14x / 1.33x)
    DECAY = 0.9

    def prior(self, key: object) -> float:
        return self.PRIOR

    @property
    def on_device(self) -> bool:
        """Its engine leaves drafts on the GPU (GpuEngine.greedy_tokens)."""
        return hasattr(self.engine, "greedy_tokens")

    def __init__(self, engine: object, target_config: object) -> None:
        cfg = engine.config
        if cfg.vocab_size != target_config.vocab_size:
            raise PycalmError(
                f"the draft model's vocabulary ({cfg.vocab_size:,} tokens) is not the target's "
                f"({target_config.vocab_size:,}): a draft model needs the target's tokenizer"
            )
        self.engine = engine
        self._cached: list[int] = []  # the tokens whose keys and values its cache holds, from position 0
        self._pending: Draft | None = None  # drafts on the GPU, whose tokens _cached lacks but the last

    def forget(self) -> None:
        self._cached, self._pending = [], None

    def _settle(self) -> None:
        """The drafts of the last propose on the GPU into _cached (but the last, unless a step
        beside the target's pass fed it: DeviceTokens.fed_last)."""
        if self._pending is not None:
            drafted, self._pending = self._pending, None
            tokens = drafted.take()
            self._cached = self._cached + (tokens if drafted.device.fed_last else tokens[:-1])

    def prefill(self, ids: list[int], start_pos: int) -> None:
        """ids into its cache at start_pos.., beside the target's prefill (the prompt's pass
        takes the draft model's share of it, not the first pass's draft steps)."""
        self._settle()
        if start_pos <= len(self._cached) and ids:
            self.engine.prefill(ids, start_pos)
            self._cached = self._cached[:start_pos] + list(ids)

    def source(self, context: list[int]) -> str | None:
        return "model" if len(context) < self.engine.seq_len else None

    def propose(self, context: list[int], k: int) -> Draft:
        e = self.engine
        self._settle()
        most = min(len(self._cached), len(context) - 1)  # the last token is fed by the first draft step
        common = most if context[:most] == self._cached[:most] else 0  # (the usual case, at C speed)
        while common < most and self._cached[common] == context[common]:
            common += 1
        catch_up = context[common:-1]  # the text its cache lacks, but the last token
        fed = context[-1:]  # fed by the token steps that draft
        if len(catch_up) == 1:  # after a pass that kept every draft: one more token step, not a pass
            fed = catch_up + fed
        elif len(catch_up) <= CATCH_UP_PASSES * ROWS_MOST:
            # the text of a stretch it did not draft for, in prompts of up to ROWS_MOST tokens (on
            # the GPU each a replay of the captured rows pass: GpuEngine.prefill)
            for at in range(0, len(catch_up), ROWS_MOST):
                e.prefill(catch_up[at : at + ROWS_MOST], common + at)
        else:
            e.prefill(catch_up, common)
        k = min(k, e.seq_len - len(context) + 1)
        if k <= 0:
            self._cached = context[: len(context) - len(fed)]
            return Draft([])
        draft = self.draft(fed, len(context) - len(fed), k)
        draft.caught_up = len(catch_up) > 1
        if draft.device is None:
            self._cached = context + draft.tokens[:-1]
        else:  # (its tokens join _cached once they are read)
            self._cached, self._pending = list(context), draft
        return draft

    def draft(self, fed: list[int], pos: int, k: int) -> Draft:
        """k greedy tokens of its engine after it is fed `fed` at pos..: on the GPU left there
        (engine.greedy_tokens: Draft.device), and the last fed by one more step that runs beside
        the target's pass; elsewhere read back step by step (engine.generate)."""
        e = self.engine
        if self.on_device:
            return Draft([], device=e.greedy_tokens(fed, pos, k, feed_last=True))
        return Draft(list(e.generate(fed, pos, k, GREEDY)))


# -------------------------------------------------------------------------------------------
# the loop


@dataclass
class Stats:
    """What the loop did, summed over calls (the benchmark reads it)."""

    passes: int = 0  # verification passes
    drafted: int = 0  # drafts they checked
    kept: int = 0  # drafts kept (and given: up to an EOS and max_new)
    pass_tokens: int = 0  # tokens the passes gave (kept drafts and the target's own)
    plain_tokens: int = 0  # tokens from plain token steps

    @property
    def acceptance_length(self) -> float:
        """Tokens a verification pass gives, on average (1 to k + 1)."""
        return self.pass_tokens / self.passes if self.passes else 0.0


@dataclass
class SpeculationOptions:
    k: int | None = None  # drafts a pass (None: adaptive, up to k_most)
    k_most: int = K_MOST
    costs: PassCosts | None = None  # None: measured on the engine at the first call
    stats: Stats = field(default_factory=Stats)
    greedy_only: bool = False  # a sampled call (temperature > 0) decodes plainly


def speculation_default(engine: object) -> str:
    """What --speculate auto means on `engine`: n-gram lookup, for greedy calls, on the GPU
    engine's captured passes; off elsewhere. Measured end to end on an H100 (docs/BENCHMARKS.md,
    adaptive k): 1.1-1.8x on input-grounded prompts (Qwen2.5-Coder-1.5B and 0.5B), 0.98x on open
    chat and code completion, where the drafts mostly miss. The CPU engine's rows pass costs
    about 3 token steps (it does not pay there), the simulator, the simple kernels and Mixtral
    have no captured pass, a model the multi-token forward does not take (rows_refusal) has no
    rows pass, and sampled calls were not measured."""
    gpu = getattr(engine, "device", None) == "gpu" and getattr(engine, "use_graph", False)
    fast = rows_refusal(engine) is None
    captured = not engine.config.n_experts  # Mixtral's rows pass is not captured (its expert groups)
    return "ngram" if gpu and fast and captured else "off"


def rows_refusal(engine: object) -> str | None:
    """Why `engine` has no rows pass to verify drafts with (one line), or None where it has."""
    if not hasattr(engine, "forward_rows"):
        return "speculative decoding needs an engine with a rows pass (forward_rows)"
    if getattr(engine, "simple", False):
        return "speculative decoding runs the fast kernels' rows pass (not --kernels simple)"
    if not getattr(engine, "multi_token", True):  # (a GpuEngine; the CPU engine takes every model)
        from pycalm.gpu.prefill import unsupported

        return f"speculative decoding needs the rows pass, and the multi-token forward does not take {unsupported(engine.config)}"
    return None


class SpeculativeEngine:
    """An engine whose generate() speculates with `drafter`; every other attribute is the
    wrapped engine's. The engine needs forward_rows (and set_next, to leave its token-step
    state as plain decoding does)."""

    def __init__(self, engine: object, drafter: object, options: SpeculationOptions | None = None) -> None:
        if why := rows_refusal(engine):
            raise PycalmError(why)
        self.engine, self.drafter = engine, drafter
        self.options = options or SpeculationOptions()
        self.stats = self.options.stats
        self._adaptive: AdaptiveK | None = None
        self._history: list[int] = []  # the tokens at positions 0.. of the engine's cache
        self._clock = 0  # tokens generated over every call: AdaptiveK's time (a source's off_until)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    # what feeds the cache outside generate moves the history with it
    def _fed(self, ids: list[int], start_pos: int) -> None:
        """ids went into the cache at start_pos..: the history follows (unknown past a gap)."""
        known = start_pos <= len(self._history)
        self._history = self._history[:start_pos] + list(ids) if known else []

    def prefill(self, ids: list[int], start_pos: int) -> None:
        self.engine.prefill(ids, start_pos)
        self._draft_prefill(ids, start_pos)
        self._fed(ids, start_pos)

    def _draft_prefill(self, ids: list[int], start_pos: int) -> None:
        """A drafter with a cache of its own (ModelDrafter) takes the prompt with the target."""
        if hasattr(self.drafter, "prefill"):
            self.drafter.prefill(ids, start_pos)

    def prefill_logits(self, ids: list[int], start_pos: int) -> Iterator[np.ndarray]:
        self._fed([], start_pos)  # (the history resumes once every block is out)
        yield from self.engine.prefill_logits(ids, start_pos)
        self._fed(ids, start_pos)

    def embed(self, ids: list[int], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        self._fed([], 0)
        out = self.engine.embed(ids, pooling, normalize)
        self._fed(ids, 0)
        return out

    def logits(self, token: int, pos: int) -> np.ndarray:
        out = self.engine.logits(token, pos)
        self._fed([token], pos)
        return out

    def _adapt(self, pos: int) -> AdaptiveK:
        """The AdaptiveK of this engine, its pass costs measured at pos on the first call
        (where the cache has no room left to time them there: no drafting this call)."""
        if self._adaptive is None:
            costs = self.options.costs
            if costs is None and self.options.k is None:
                if pos + FIRST_CALL_ROWS[-1] > self.engine.seq_len:
                    return AdaptiveK(PassCosts.ratio(float("inf")), self.options.k_most)
                # before the call's first token: one timing each, of the passes k picks between
                costs = measure_costs(self.engine, pos, self.drafter, FIRST_CALL_ROWS, repeats=1)
            # measured costs are seconds of this engine: each pass's wall time corrects them
            online = costs is not None and costs.measured
            self._adaptive = AdaptiveK(costs, self.options.k_most, self.options.k, online=online)
        return self._adaptive

    def generate(
        self,
        ids: list[int],
        start_pos: int,
        max_new: int,
        sampling: SamplingParams,
        logprobs: int | None = None,
        prefix: list[int] | None = None,
        constraint: object | None = None,
    ) -> Iterator[int]:
        """engine.generate's contract (feed ids at start_pos.., then up to max_new tokens,
        stopping after an EOS, unless sampling.ignore_eos, or at the end of the context),
        speculating; with logprobs, penalties or a logit bias, a constraint, min_tokens (its EOS
        mask is a constraint), a sampled call under options.greedy_only, or where the cache's
        earlier tokens are unknown, plain engine.generate (prefix: its repetition penalty's
        cached prompt)."""
        e = self.engine
        plain = (
            logprobs is not None or sampling.penalized or constraint is not None or sampling.min_tokens > 0
        ) or (self.options.greedy_only and sampling.temperature > 0)
        if plain or start_pos > len(self._history) or not ids:
            self._fed(ids, start_pos)
            known, given = self._history, []
            self._history = []  # until the call is over
            try:
                options = {} if constraint is None else {"constraint": constraint}
                for item in e.generate(ids, start_pos, max_new, sampling, logprobs, prefix=prefix, **options):
                    given.append(item if logprobs is None else item.token)
                    yield item
            finally:
                self._history = (known + given)[:-1] if known else []  # the last token is not fed
            return
        end = start_pos + len(ids)
        if end > e.seq_len:
            raise PycalmError(
                f"prompt of {len(ids)} tokens at position {start_pos} does not fit the context of {e.seq_len} tokens"
            )
        adaptive = self._adapt(end - 1) if max_new > 0 else None
        history = self._history[:start_pos] + list(ids)  # the tokens at positions 0 .. pos
        self._history = []  # until this call leaves the cache known
        if len(ids) > 1:
            e.prefill(ids[:-1], start_pos)
            self._draft_prefill(ids[:-1], start_pos)
        last, pos = ids[-1], end - 1  # the next token to feed, and its position
        room = min(max_new, e.seq_len - pos)  # the tokens this call may give
        coins = np.random.default_rng(sampling.seed).random(room)  # the j-th token's coin
        eos = sampling.end_ids(e.config.eos_ids)
        produced = 0
        plain = None  # a stretch of plain token steps in flight (engine.generate)
        stretch = PLAIN_RUN  # the next stretch's tokens where nothing is drafted
        try:
            while produced < room:
                key = self.drafter.source(history)
                k = 0 if key is None else adaptive.plan(key, self._clock, self._prior(key))
                k = min(k, room - produced - 1, ROWS_MOST - 1)
                if k <= 0:  # plain token steps, the j-th token with the j-th coin
                    # each stretch is a call of engine.generate, whose start and end leave the GPU
                    # idle a moment (H100, Qwen2.5-0.5B: 0.1-0.2 ms, a fifth of a token step):
                    # where lookups keep finding no source at all the stretches grow; a source
                    # found (on or off) takes them back to PLAIN_RUN
                    run = stretch
                    if key is not None and getattr(self.drafter, "one_source", False):
                        # a draft model: nothing comes up before its stretch off is over
                        run = max(adaptive.off_until(key) - self._clock, 1)
                    run = min(run, room - produced)
                    stretch = PLAIN_RUN if key is not None else min(2 * stretch, PLAIN_MOST)
                    out = plain = e.generate([last], pos, run, replace(sampling, first_coin=produced))
                else:
                    t0 = time.perf_counter()
                    draft = self.drafter.propose(history, k)
                    out = self._verify(
                        last, pos, draft, sampling, coins[produced : produced + len(draft) + 1]
                    )
                    # the pass's wall time; not one that holds a draft model's catch-up (a probe
                    # after a stretch off): the costs model the passes between
                    seconds = None if draft.caught_up else time.perf_counter() - t0
                    decay = getattr(self.drafter, "DECAY", DECAY)
                    adaptive.update(key, len(draft.tokens), len(out) - 1, decay, seconds)
                    given = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
                    given = min(given, room - produced)  # the tokens of the pass that go out
                    self.stats.passes += 1
                    self.stats.drafted += len(draft.tokens)
                    self.stats.kept += min(len(out) - 1, given)
                    self.stats.pass_tokens += given
                for token in out:  # (a plain stretch's tokens as they come)
                    self.stats.plain_tokens += plain is not None
                    history.append(token)
                    last, pos = token, pos + 1
                    produced += 1
                    self._clock += 1
                    yield token
                    if token in eos or produced == room:
                        return
                if plain is not None:
                    plain.close()
                    plain = None
        finally:
            if plain is not None:
                plain.close()
            self._history = history[:-1]  # the last token is never fed
            e.set_next(last, pos)

    def _prior(self, key: object) -> float:
        """The drafter's acceptance for a source not seen yet (PRIOR where it gives none)."""
        prior = getattr(self.drafter, "prior", None)
        return PRIOR if prior is None else prior(key)

    def _verify(
        self, last: int, pos: int, draft: Draft, sampling: SamplingParams, coins: np.ndarray
    ) -> list[int]:
        """One pass over [last] + the drafts at pos: the drafts kept and the target's token after
        them (the module docstring)."""
        if draft.q is None:  # one-hot drafts: each row samples on the device with its own coin
            sampled = check_drafts(self.engine, last, pos, draft, sampling, coins)
            kept = 0
            while kept < len(draft.tokens) and sampled[kept] == draft.tokens[kept]:
                kept += 1
            out = [*draft.tokens[:kept], int(sampled[kept])]
        else:  # the rejection rule on the host, on the target's logits
            rows = [last, *draft.tokens]
            logits = self.engine.forward_rows(rows, pos)  # (k + 1, vocab_size)
            s = sampling
            p = np.stack(
                [target_distribution_ref(x, s.temperature, s.top_k, s.top_p, s.min_p) for x in logits]
            )
            pair = np.random.default_rng([s.seed, pos, len(rows)]).random((len(rows), 2))
            pair[:, 0] = coins
            out = verify_ref(p, draft.q, draft.tokens, pair)
        return out


def check_drafts(
    engine: object, last: int, pos: int, draft: Draft, sampling: SamplingParams, coins: np.ndarray
) -> np.ndarray:
    """The (n,) tokens that one pass of engine's rows over [last] + the n - 1 one-hot drafts at
    pos samples, each row with its own coin. Drafts still on the GPU (Draft.device) go into the
    pass there (forward_rows' tail), so the host waits once, for the pass; draft.tokens is
    filled."""
    n = len(draft) + 1  # the rows
    if draft.device is not None and hasattr(engine, "greedy_tokens"):
        sampled = engine.forward_rows([last], pos, [sampling] * n, coins, tail=draft.device)
        draft.take()  # (their event passed before the pass began)
        return sampled
    return engine.forward_rows([last, *draft.take()], pos, [sampling] * n, coins)


def make_drafter(kind: str, target: object, draft_engine: object = None) -> object | None:
    """The drafter of a --speculate choice (None for off); "draft" needs the draft model's engine."""
    if kind not in ("off", "ngram", "draft"):  # (auto: settled by speculation_default first)
        raise PycalmError(f"speculate must be one of off, ngram, draft, not {kind!r}")
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft":
        if draft_engine is None:
            raise PycalmError("--speculate draft needs a draft model (--draft-model)")
        return ModelDrafter(draft_engine, target.config)
    return None
