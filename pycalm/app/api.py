"""The Python API: `pycalm.load(MODEL)` and the `LLM` it returns.

    import pycalm

    llm = pycalm.load("smollm2", device="cpu")
    print(llm.generate("The capital of France is", max_tokens=8, temperature=0))
    for piece in llm.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(piece, end="", flush=True)
    vectors = llm.embed(["a text", "another"])  # (2, dim) float32, unit rows

MODEL is anything `python -m pycalm.generate` takes (a pycalm file, a Hugging Face folder, a
GGUF file, a known name), resolved, converted and cached the same way. The LLM wraps one engine
(the GPU's or the CPU reference) and one KV cache, and runs one generation at a time.

Choices: generate(..., n=k) (k up to MAX_CHOICES) makes k continuations of one prompt, one after
another, choice i with seed + i; the prompt is fed once (the prefix reuse below: each later
choice feeds only the prompt's last token and overwrites the cache rows after it).

KV-cache prefix reuse: the LLM remembers which token ids the cache holds. A request whose
prompt starts with them (the next turn of a chat, a prompt that extends the last one) feeds
only the tokens after the common prefix, at start_pos = the prefix length. The cache never
holds the logits of its last token, so at most len(prompt) - 1 tokens are reused and at least
one is fed. `Generation.reused_tokens` says how many were.

Embeddings (LLM.embed, the server's /v1/embeddings) feed each text alone from position 0, so a
text's vector does not depend on what else is asked with it or what the cache held; they
overwrite the cache's first rows, so the LLM forgets what it held (the next prompt is fed whole).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pycalm.app.generation import Generation, StopText
from pycalm.cpu.sampler import SamplingParams
from pycalm.errors import PycalmError

if TYPE_CHECKING:
    from pycalm.app.tools import ToolCallParser

# {"role": "system" | "user" | "assistant" | "tool", "content": text}; an assistant's may carry
# "tool_calls" (OpenAI's shape), a tool's its "tool_call_id" (pycalm.app.tools)
Message = dict[str, Any]
MAX_CHOICES = 8  # the most continuations (n) one request asks for
MAX_BATCH = 32  # the most prompts of a list LLM.generate advances in one pass


def load(
    model: str | Path | None = None,
    *,
    device: str = "auto",
    dtype: str = "fp16",
    context: int = 4096,
    kv: str = "auto",
    cache_dir: str | Path | None = None,
    verbose: bool = True,
    batch_invariant: bool = False,
    kernels: str = "fast",
    threads: int | None = None,
    speculate: str = "auto",
    draft_model: str | Path | None = None,
    draft_k: int | None = None,
) -> LLM:
    """Open MODEL (default: SmolLM2-135M-Instruct, fetched once) on `device` (auto, gpu, cpu).
    MODEL is what the CLI takes: a pycalm file, a Hugging Face folder, a GGUF file, a known name,
    or a Hugging Face Hub name, ORG/NAME or ORG/NAME:TAG (pycalm.app.hub), downloaded once.

    dtype: the weight format when converting a Hugging Face folder or GGUF (fp16, fp8, gf4, q8, q4);
    context: the positions to allocate (at most the model's); kv: the KV-cache format (auto,
    fp16, fp8). verbose: one-line notices (fetching, converting, the CPU fallback) on stderr.
    batch_invariant: every token through one path (the GPU's multi-token forward, the CPU's
    token step), so a prompt gives the same tokens however much of it was cached (slower decode
    on the GPU, a slower prompt on the CPU).
    kernels: on the GPU, "fast" or "simple" (the plain kernels of pycalm/kernels/simple/: the
    same tokens, slower).
    threads: the CPU engine's BLAS threads (default 1; pycalm.cpu.engine says why).
    speculate: speculative decoding, "auto" (n-gram lookup for greedy calls on the GPU, where it
    measured to pay; off on the CPU: pycalm.app.speculative.speculation_default), "off", "ngram"
    (drafts looked up in the prompt and the text so far) or "draft" (drafts from draft_model, a
    small model with the same vocabulary, MODEL's forms); the output is plain decoding's
    (pycalm.app.speculative). draft_k: drafts a pass (None: adapts to how many are kept).
    Raises PycalmError with a one-line message for anything the caller can fix.
    """
    from pycalm.app.models import make_engine, make_speculative, resolve_model
    from pycalm.cpu.engine import check_threads
    from pycalm.model.config import WEIGHT_DTYPES
    from pycalm.model.loader import open_model
    from pycalm.model.tokenizer import Tokenizer
    from pycalm.paths import cache_dir as default_cache_dir

    if device not in ("auto", "gpu", "cpu"):
        raise PycalmError(f"device must be auto, gpu or cpu, not {device!r}")
    if dtype not in WEIGHT_DTYPES:
        raise PycalmError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {dtype!r}")
    if kernels not in ("fast", "simple"):
        raise PycalmError(f"kernels must be fast or simple, not {kernels!r}")
    if kv not in ("auto", "fp16", "fp8"):
        raise PycalmError(f"kv must be auto, fp16 or fp8, not {kv!r}")
    if context < 2:
        raise PycalmError(f"context must be 2 or more, not {context}")
    check_threads(threads)

    def log(msg: str) -> None:
        if verbose:
            print(msg, file=sys.stderr, flush=True)

    from pycalm.gpu import kernel_cache as kernel_cache

    # compiled kernels are kept beside the models, as the CLI keeps them (set before the kernel
    # modules are imported)
    kernel_cache.set_root(default_cache_dir(cache_dir))
    path = resolve_model(None if model is None else str(model), dtype, default_cache_dir(cache_dir), log)
    model_file = open_model(path)
    cfg = model_file.config
    tok = Tokenizer.from_blob(
        model_file.tokenizer_kind,
        model_file.tokenizer_blob,
        cfg.bos_id,
        cfg.eos_ids,
        model_file.chat_template,
    )
    engine = make_engine(
        model_file,
        device,
        min(context, cfg.max_seq_len),
        kv,
        log,
        batch_invariant=batch_invariant,
        kernels=kernels,
        threads=threads,
    )
    engine = make_speculative(
        engine,
        speculate,
        draft_model=None if draft_model is None else str(draft_model),
        draft_k=draft_k,
        dtype=dtype,
        cache=default_cache_dir(cache_dir),
        kv=kv,
        log=log,
        threads=threads,
    )
    return LLM(engine, tok, name=model_name(model), path=path)


def model_name(model: str | Path | None) -> str:
    """The name a model is shown under (the server's model id): a known name, a Hugging Face
    name as given (ORG/NAME[:TAG]), or the file or folder name of a path."""
    from pycalm.app.fetch import DEFAULT_MODEL
    from pycalm.app.hub import parse_hub_name

    if model is None:
        return DEFAULT_MODEL
    if not Path(model).exists() and parse_hub_name(str(model)) is not None:
        return str(model)
    return Path(model).name


class LLM:
    """A loaded model: generate / chat / embed / tokenize / detokenize / perplexity on one engine."""

    def __init__(
        self, engine: object, tokenizer: object, name: str = "model", path: Path | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = engine.config
        self.name = name
        self.path = path
        self.seq_len = engine.seq_len  # positions the KV cache holds
        self.device = engine.device
        self._cached: list[int] = []  # token ids whose keys and values are in the cache, in order
        self._active: Generation | None = None
        template = getattr(tokenizer, "chat_template", "")
        from pycalm.app.tools import tool_format

        self.tool_format = tool_format(template)  # how this model writes a tool call

    # ---- text <-> ids --------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text` (the model's BOS first when add_bos and the model has one)."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: list[int]) -> str:
        """Text of `ids`, as the tokenizer library decodes it."""
        return self.tokenizer.decode(ids)

    def chat_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a conversation: the model's chat template, with the assistant's turn
        opened; `tools` (OpenAI's function tools) rendered by the template, or by pycalm where the
        template knows none (pycalm.app.tools), as are the messages' calls and results."""
        from pycalm.app.tools import template_knows_tools, template_messages

        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            knows = template_knows_tools(self.tokenizer.chat_template)
            messages, tools = template_messages(messages, tools, knows)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.encode(text, add_bos=False)

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        max_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 0.9,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stream: bool = False,
        *,
        prime: bool = True,
        logprobs: int | None = None,
        n: int = 1,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        tool_parser: ToolCallParser | None = None,
        response_format: dict | None = None,
        grammar: str | None = None,
        regex: str | None = None,
    ) -> str | Generation | list[str] | list[Generation] | Iterator[Generation]:
        """The continuation of `prompt` (text, encoded with the BOS, or token ids as they are).

        Stops at an EOS, after max_tokens tokens, at the end of the context, or before the first
        of the `stop` strings (which is not part of the text). temperature 0 is greedy; top_p 1,
        top_k 0 and min_p 0 are off; seed None takes one from the clock. stream=True returns a
        Generation, an iterator of text pieces as they are made; else the whole text. prime:
        the text is decoded as the continuation of the prompt (its first space kept); False
        decodes it as text of its own (a chat reply). logprobs = k (0 to 20): each token's
        log-probability under the model (before temperature) and the k most likely tokens' in
        Generation.logprobs, which is then returned whole (its text in .text) when not streaming.
        tool_parser: the tool calls are parsed out of the text (LLM.chat's tools=, which sets it).
        Constrained decoding (pycalm.app.constrain), one of: response_format, OpenAI's
        {"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema":
        {"name": ..., "schema": {...}}} (a JSON value valid against the schema); grammar, a Lark
        grammar (llguidance's dialect, `%json {...}` embeds a schema); regex, a pattern the whole
        output matches. Generation then stops once the output is complete (finish_reason "stop").

        Penalties (pycalm.cpu.reference.penalties_ref; the logprobs stay the model's):
        presence_penalty and frequency_penalty (-2 to 2, OpenAI's) subtract p * [count > 0] + f *
        count for each token generated so far; repetition_penalty r (> 0, 1: off, llama.cpp's
        --repeat-penalty) divides a positive logit (multiplies a negative one) by r for the
        tokens of the prompt and those generated; logit_bias {token id: -100 to 100} is added last
        (+100 forces a token, -100 bans it).

        The end of the text (vLLM's fields): min_tokens (0 to max_tokens), no EOS among the first
        min_tokens tokens (their logits at -inf: pycalm.cpu.sampler.MinTokens; the logprobs of
        those tokens are then over the other ids) and no stop string ends the text before it has
        that many; ignore_eos, an EOS does not end the text (it runs to max_tokens, a stop string
        or the end of the context; the EOS is counted and has no text).

        n = k (1 to MAX_CHOICES): k continuations, choice i drawn with seed + i (at temperature 0
        all alike), the prompt fed once: a list of what n = 1 returns, or with stream=True an
        iterator of the k Generations, each made when the one before it is done (taking the next
        one ends an unfinished one).

        A list of prompts (texts, or lists of token ids) is generated together by continuous
        batching (pycalm.app.batching: up to MAX_BATCH sequences a pass over a paged KV cache),
        each with these options and seed as if alone: a list of what one prompt returns (n = 1,
        no streaming, no tools). Where the engine has no batched forward (speculative decoding,
        --batch-invariant on the GPU, --kernels simple) the prompts run one after another.
        """
        from dataclasses import replace

        from pycalm.cpu.sampler import check_min_tokens

        check_min_tokens(min_tokens, ignore_eos, max_tokens)
        bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        sampling = SamplingParams(
            temperature,
            top_k,
            top_p,
            min_p,
            _seed(seed),
            presence_penalty,
            frequency_penalty,
            repetition_penalty,
            bias,
            int(min_tokens),
            bool(ignore_eos),
        )

        def constraint() -> object:  # a fresh matcher a choice (a constraint follows one output)
            return self.constraint(response_format=response_format, grammar=grammar, regex=regex)

        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (int, np.integer)):
            if stream or n != 1 or tool_parser is not None:
                raise PycalmError("a list of prompts takes n = 1, no streaming and no tools")
            return self._generate_many(prompt, max_tokens, sampling, stop, prime, logprobs, constraint)
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise PycalmError(f"n must be a whole number from 1 to {MAX_CHOICES}, not {n!r}")
        if n > 1 and tool_parser is not None:
            raise PycalmError("n > 1 does not go with tools (one choice a chat with tools)")

        def choice(i: int) -> Generation:
            return self.start(
                ids,
                max_tokens,
                replace(sampling, seed=sampling.seed + i),
                stop,
                prime,
                logprobs=logprobs,
                constraint=constraint(),
                tool_parser=tool_parser,
            )

        if n > 1:
            if stream:
                choice(0).close()  # the arguments checked now, not at the first next()
                return (choice(i) for i in range(n))
            return [_finished(choice(i), logprobs) for i in range(n)]
        gen = choice(0)
        return gen if stream else _finished(gen, logprobs)

    def _generate_many(
        self,
        prompts: list,
        max_tokens: int,
        sampling: SamplingParams,
        stop: str | list[str] | None,
        prime: bool,
        logprobs: int | None,
        constraint: Callable[[], object],
    ) -> list[str] | list[Generation]:
        """generate over a list of prompts (texts or lists of ids) with these options: batched by
        the continuous-batching runner where the engine has a batched forward, else one after
        another; constraint() makes each prompt's fresh matcher."""
        from pycalm.app.batching import BatchRunner, batch_refusal
        from pycalm.batch.blocks import BLOCK_SIZE

        ids = [self.tokenize(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        if batch_refusal(self.engine) or max_tokens < 1:
            return [
                _finished(self.start(p, max_tokens, sampling, stop, prime, logprobs=logprobs, constraint=constraint()), logprobs)
                for p in ids
            ]  # fmt: skip
        stops = [self._check_start(p, max_tokens, sampling, stop, logprobs) for p in ids]
        limits = [min(max_tokens, self.seq_len + 1 - len(p)) for p in ids]  # the context's end
        blocks = sum(
            -(-(len(p) + k) // BLOCK_SIZE) for p, k in zip(ids, limits, strict=True)
        )  # every one at once
        runner = BatchRunner(self, min(len(prompts), MAX_BATCH), n_blocks=blocks)
        streams = [
            runner.add(p, k, sampling, lambda *_: None, stop=stop_strings, prime=prime, logprobs=logprobs,
                       constraint=constraint())
            for p, k, stop_strings in zip(ids, limits, stops, strict=True)
        ]  # fmt: skip
        while not runner.idle():
            runner.step()
        return [s.gen.text if logprobs is None else s.gen for s in streams]

    def chat(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        **options: Any,
    ) -> str | dict[str, Any] | Generation:
        """The assistant's reply to `messages` ([{"role", "content"}, ...]), rendered with the
        model's own chat template; the options (max_tokens, temperature, top_p, top_k, min_p,
        seed, stop, stream, logprobs, n, the penalties, logit_bias, min_tokens, ignore_eos,
        response_format, grammar, regex) as for generate, which runs it. A conversation that goes
        on turn after turn reuses the cache of the turns before (only the new tokens are fed).

        tools: OpenAI's function tools ([{"type": "function", "function": {"name", "description",
        "parameters"}}]), offered to the model through its chat template; tool_choice: "auto"
        (the default: the model decides), "none" (the tools are not offered), "required" (one
        call or more) or {"type": "function", "function": {"name": NAME}} (one call of it): these
        two by constrained decoding, in the model's own call form (pycalm.app.tools.tool_grammar). With tools the reply is OpenAI's
        assistant message, {"role": "assistant", "content": text or None, "tool_calls": [...]}
        (tool_calls only when the model called some), which the next turn's messages take as
        it is, followed by {"role": "tool", "tool_call_id": ID, "content": RESULT} for each call;
        streamed (or with logprobs), a Generation whose pieces are the text and whose
        tool_calls and message fill in as the calls are made (pycalm.app.tools).
        """
        from pycalm.app.tools import ToolCallParser, check_tool_choice, check_tools, tool_grammar

        if tools is None:
            if tool_choice not in (None, "none"):
                raise PycalmError("tool_choice needs tools")
            return self.generate(self.chat_ids(messages), **options, prime=False)
        choice = check_tool_choice(tool_choice, check_tools(tools))
        offered = tools if choice != "none" else None
        names = frozenset(t["function"]["name"] for t in tools)
        parser = ToolCallParser(names) if offered else None
        if choice not in ("auto", "none"):  # the calls forced, in the model's own form
            if any(options.get(k) is not None for k in ("response_format", "grammar", "regex")):
                raise PycalmError(
                    "tool_choice required or named goes with no response_format, grammar or regex"
                )
            options["grammar"] = tool_grammar(self.tool_format, tools, choice)
        stream = options.pop("stream", False)
        gen = self.generate(
            self.chat_ids(messages, offered), **options, stream=True, prime=False, tool_parser=parser
        )
        if stream:
            return gen
        for _ in gen:
            pass
        return gen if options.get("logprobs") is not None else gen.message

    def constraint(
        self, *, response_format: dict | None = None, grammar: str | None = None, regex: str | None = None
    ) -> object | None:
        """A fresh pycalm.app.constrain.Constraint for one generation over this model's vocabulary
        (None where none of the three is given); a bad one is a PycalmError of one line."""
        if response_format is None and grammar is None and regex is None:
            return None
        from pycalm.app.constrain import make_constraint

        return make_constraint(
            self.tokenizer,
            response_format=response_format,
            grammar=grammar,
            regex=regex,
            vocab_size=self.config.vocab_size,
        )

    def tool_constraint(self, tools: list[dict], choice: str) -> object:
        """The Constraint that forces tool calls in this model's form (tool_choice "required"
        or a tool's name; pycalm.app.tools.tool_grammar)."""
        from pycalm.app.tools import tool_grammar

        return self.constraint(grammar=tool_grammar(self.tool_format, tools, choice))

    def start(
        self,
        ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: str | list[str] | None = None,
        prime: bool = True,
        cancelled: Callable[[], bool] | None = None,
        logprobs: int | None = None,
        tool_parser: ToolCallParser | None = None,
        constraint: object | None = None,
    ) -> Generation:
        """A Generation for prompt `ids` (what generate and chat return; the server calls it).

        prime: decode the text as the continuation of the prompt (a leading space is kept), as
        the CLI's prompt mode does; else as text of its own, as its chat mode does. cancelled:
        asked after every token; True ends the generation there (finish_reason None).
        logprobs: k, the top logprobs each token lists in Generation.logprobs (None: none kept).
        tool_parser: parses the tool calls out of the text into Generation.tool_calls.
        constraint: a fresh pycalm.app.constrain.Constraint (LLM.constraint) the tokens follow.
        Checks the arguments here, before the first piece is asked for.
        """
        stops = self._check_start(ids, max_tokens, sampling, stop, logprobs)
        if self._active is not None:  # one generation at a time: an abandoned stream ends here
            self._active.close()
        gen = Generation(
            prompt_tokens=len(ids),
            logprobs=None if logprobs is None else [],
            tool_calls=None if tool_parser is None else [],
        )
        gen._pieces = self._pieces(
            gen, ids, max_tokens, sampling, stops, prime, cancelled, logprobs, constraint, tool_parser
        )
        self._active = gen
        return gen

    def _check_start(
        self,
        ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: str | list[str] | None,
        logprobs: object,
    ) -> list[str]:
        """start's checks of its arguments (a PycalmError naming the first bad one) -> the stop
        strings as a list."""
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise PycalmError("stop strings must be non-empty strings")
        if not ids:
            raise PycalmError("empty prompt and the model has no BOS token to start from")
        if len(ids) >= self.seq_len:
            raise PycalmError(f"prompt is {len(ids)} tokens, longer than the context of {self.seq_len}")
        if max_tokens < 0:
            raise PycalmError(f"max_tokens must be 0 or more, not {max_tokens}")
        from pycalm.cpu.reference import MAX_TOP_LOGPROBS, check_penalties, check_sampling
        from pycalm.cpu.sampler import check_min_tokens

        s = sampling
        check_sampling(s.temperature, s.top_k, s.top_p, s.min_p)
        check_min_tokens(s.min_tokens, s.ignore_eos)
        check_penalties(
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty,
            s.logit_bias,
            self.config.vocab_size,
        )
        if logprobs is not None and (
            isinstance(logprobs, bool)
            or not isinstance(logprobs, int)
            or not 0 <= logprobs <= MAX_TOP_LOGPROBS
        ):
            raise PycalmError(
                f"logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}, not {logprobs!r}"
            )
        return stops

    def _pieces(
        self,
        gen: Generation,
        ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stops: list[str],
        prime: bool,
        cancelled: Callable[[], bool] | None,
        logprobs: int | None = None,
        constraint: object | None = None,
        tool_parser: ToolCallParser | None = None,
    ) -> Iterator[str]:
        common = 0
        limit = min(len(ids) - 1, len(self._cached))  # feed at least one token
        while common < limit and ids[common] == self._cached[common]:
            common += 1
        gen.reused_tokens = common
        self._cached = self._cached[:common]  # positions past it are rewritten from here on
        decoder = self.tokenizer.stream()
        if prime:  # the continuation's first space is kept
            for t in ids:
                decoder.push(t)
            decoder.flush()
        eos = set(self.config.eos_ids)  # the model's: their text is not handed out
        ends = sampling.end_ids(self.config.eos_ids)  # the ids that end the reply (none: ignore_eos)
        reply: list[int] = []
        text = StopText(stops, sampling.min_tokens)

        def handed_out(events: list[tuple[str, Any]]) -> Iterator[str]:
            """The tool parser's events as pieces: its text, and "" for a call (now in tool_calls)."""
            for kind, value in events:
                if kind == "call":
                    gen.tool_calls.append(value)
                yield value if kind == "content" else ""

        if max_tokens == 0:
            gen.finish_reason = "length"
            return
        t0 = time.perf_counter()
        t_first = t0
        # the cached prefix too: repetition_penalty counts the whole prompt
        options = {"prefix": ids[:common]} if sampling.penalized else {}
        if constraint is not None:
            options["constraint"] = constraint
        if logprobs is None:
            tokens = self.engine.generate(ids[common:], common, max_tokens, sampling, **options)
        else:  # TokenLogprobs a token
            tokens = self.engine.generate(
                ids[common:], common, max_tokens, sampling, logprobs=logprobs, **options
            )
        try:
            for item in tokens:
                t = item if logprobs is None else item.token
                now = time.perf_counter()
                if not reply:
                    t_first = now
                    gen.prompt_s = now - t0
                gen.decode_s = now - t_first
                reply.append(t)
                gen.completion_tokens = len(reply)
                if cancelled is not None and cancelled():
                    return
                if t in ends:
                    gen.finish_reason = "stop"
                    break
                if gen.logprobs is not None:
                    gen.logprobs.append(item)
                if piece := text.push("" if t in eos else decoder.push(t)):
                    if tool_parser is None:
                        yield piece
                    else:
                        yield from handed_out(tool_parser.push(piece))
                if text.stopped:
                    gen.finish_reason = "stop"
                    break
            else:  # max_tokens, the end of the context, or a constraint's finished output
                gen.finish_reason = "stop" if constraint is not None and constraint.finished else "length"
            piece = text.finish(decoder.flush)
            if tool_parser is None and piece:
                yield piece
            elif tool_parser is not None:
                yield from handed_out(tool_parser.push(piece) + tool_parser.finish())
            if text.stopped:
                gen.finish_reason = "stop"
            if gen.tool_calls and gen.finish_reason == "stop":
                gen.finish_reason = "tool_calls"
        finally:
            tokens.close()
            if reply:  # every prompt token was fed, and every sampled token but the last
                self._cached = ids + reply[:-1]
            if self._active is gen:
                self._active = None

    # ---- embeddings ----------------------------------------------------------------------------

    def embed(self, texts: str | list[str], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """The embeddings of `texts` (a string or a list of them, each encoded with the BOS), as
        llama-server's --embedding makes them: the hidden states after the model's final RMSNorm,
        pooled over the text's tokens by their "mean" or the "last" token's, scaled to unit L2
        norm when normalize. Returns (len(texts), dim) float32 (one row for a string). Each text
        is fed alone from position 0, so a row does not depend on the others."""
        items = [texts] if isinstance(texts, str) else texts
        if not isinstance(items, list | tuple) or not items:
            raise PycalmError("nothing to embed: give a string or a non-empty list of strings")
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise PycalmError(f"texts[{i}] must be a string, not {type(text).__name__}")
            if not text:
                raise PycalmError(f"texts[{i}] is an empty string")
        return self.embed_ids([self.tokenize(t) for t in items], pooling, normalize)

    def embed_ids(
        self,
        texts: list[list[int]],
        pooling: str = "mean",
        normalize: bool = True,
        cancelled: Callable[[], bool] | None = None,
    ) -> np.ndarray | None:
        """embed for texts given as token ids (what the server calls): (len(texts), dim) float32.
        cancelled: asked before each text; True stops there and returns None."""
        from pycalm.cpu.reference import check_pooling

        check_pooling(pooling)
        if not texts:
            raise PycalmError("nothing to embed: no texts given")
        for i, ids in enumerate(texts):
            if not ids:
                raise PycalmError(f"text {i} encodes to no tokens")
            if len(ids) > self.seq_len:
                raise PycalmError(f"text {i} is {len(ids)} tokens, longer than the context of {self.seq_len}")
        self.reset()  # an unfinished stream ends; the cache's first rows are about to change
        out = np.empty((len(texts), self.config.dim), np.float32)  # (n, dim)
        for i, ids in enumerate(texts):
            if cancelled is not None and cancelled():
                return None
            out[i] = self.engine.embed([int(t) for t in ids], pooling, normalize)
        return out

    # ---- evaluation ----------------------------------------------------------------------------

    def perplexity(self, text: str) -> float:
        """exp(mean negative log-likelihood) of the model on `text` (encoded with the BOS), by
        the function `python -m pycalm.generate -x FILE` uses (pycalm.app.perplexity.mean_nll): a text
        longer than the context is evaluated in context-sized windows, each scoring the tokens
        past its first half."""
        from pycalm.app.perplexity import mean_nll, windows

        ids = self.tokenize(text)
        if len(ids) < 2:
            raise PycalmError("too short to measure perplexity (needs 2 tokens or more)")
        self.reset()
        nll = mean_nll(self.engine, ids)
        start, end, _ = windows(len(ids), self.seq_len)[-1]
        self._cached = ids[start : end - 1]  # the last window, fed from position 0
        return math.exp(nll)

    def reset(self) -> None:
        """Forget what the KV cache holds (the next request feeds its whole prompt), ending an
        unfinished stream first."""
        if self._active is not None:
            self._active.close()
        self._cached = []


def _finished(gen: Generation, logprobs: int | None) -> str | Generation:
    """A generation run to its end: its text, or with logprobs the Generation (its text in .text)."""
    text = "".join(gen)
    return text if logprobs is None else gen


def _seed(seed: int | None) -> int:
    return int(seed) if seed is not None else time.time_ns() % (2**31)
