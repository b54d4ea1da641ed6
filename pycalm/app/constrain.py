"""Constrained decoding: which tokens may come next, so that the output matches a JSON schema, a
regular expression or a grammar.

The matching is llguidance's (Rust; the library llama.cpp, vLLM and SGLang use): it compiles a
JSON schema, a regex or a Lark grammar (which can embed `%json {...}`) into a parser whose
lexer is built lazily, and gives the allowed next tokens of the whole vocabulary as a bitmask in
tens of microseconds a token. pycalm hands it its own tokenizer's token byte strings (GGUF
and safetensors models alike), the control tokens marked special (a 0xFF byte in front, as
llguidance expects), and the model's EOS ids.

    c = Constraint.json_schema(tokenizer, {"type": "object", ...}, vocab_size=cfg.vocab_size)
    mask = c.mask()          # (ceil(vocab_size / 32),) uint32: bit i % 32 of word i // 32 = id i allowed
    c.accept(token)          # the sampled token moves the matcher on
    c.finished               # nothing but EOS may follow: generation stops as at an EOS

Every id at or past the tokenizer's token count (a model's vocab_size may be padded past it) is
never allowed. The engines apply the mask to the step's logits (disallowed logits to -inf:
pycalm.cpu.reference.mask_logits_ref, on the GPU pycalm.kernels.mask) before sampling, so
greedy decoding takes the best allowed token and sampling draws among the allowed ones with the
same coins as unconstrained decoding.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np

from pycalm.errors import PycalmError

# the llguidance tokenizer of each pycalm Tokenizer, built once (about a second at 150k tokens)
# and dropped with it
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mask_words(vocab_size: int) -> int:
    """uint32 words of a bitmask over vocab_size ids: one bit an id."""
    return -(-vocab_size // 32)


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads from a tokenizer: the token byte strings (control
    tokens as 0xFF + their text), EOS and BOS, and a callable that encodes text."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_ids[0] if tok.eos_ids else -1
        self.bos_token_id = tok.bos_id if tok.bos_id >= 0 else None
        special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
        self.special_token_ids = special
        tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        for i in special:
            tokens[i] = b"\xff" + (tok.token_text(i) or f"<special_{i}>").encode()
        self.tokens = tokens

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False)


def _ll_tokenizer(tok: Any) -> Any:
    """The llguidance.LLTokenizer over a pycalm Tokenizer (cached)."""
    ll = _LL_TOKENIZERS.get(tok)
    if ll is None:
        try:
            import llguidance
        except ImportError:
            raise PycalmError("constrained decoding needs llguidance: pip install llguidance") from None
        eos = list(tok.eos_ids) or None
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenizerView(tok)), eos_token=eos)
        _LL_TOKENIZERS[tok] = ll
    return ll


class Constraint:
    """One generation's matcher: the allowed next tokens as a bitmask, moved on by each token.

    Build with Constraint.json_schema, .regex or .grammar (each call gives a fresh matcher);
    a schema, regex or grammar that does not compile is a PycalmError of one line."""

    def __init__(self, tok: Any, grammar: str, what: str, vocab_size: int | None = None) -> None:
        import llguidance

        self.vocab_size = int(vocab_size if vocab_size is not None else tok.vocab_size)
        if self.vocab_size < tok.vocab_size:
            raise PycalmError(
                f"vocab_size {self.vocab_size} is below the tokenizer's {tok.vocab_size} tokens"
            )
        self.what = what  # "json_schema", "regex" or "grammar", for messages
        self.eos_ids = tuple(tok.eos_ids)
        ll = _ll_tokenizer(tok)
        self._words = mask_words(tok.vocab_size)  # the words llguidance writes
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)
        if is_error:
            raise PycalmError(f"invalid {what}: {_one_line(messages[0] if messages else 'does not compile')}")
        self._matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise PycalmError(f"invalid {what}: {_one_line(self._matcher.get_error())}")
        self.n_accepted = 0

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def json_schema(cls, tok: Any, schema: dict | None, *, vocab_size: int | None = None) -> Constraint:
        """Output that is a JSON value valid against `schema` (None: any JSON object), on one
        line, with ", " and ": " between items (no free whitespace, which a model can repeat
        without end)."""
        import llguidance

        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise PycalmError(f"a JSON schema must be an object, not {type(schema).__name__}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema),
                overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
            )
        except (ValueError, TypeError) as e:
            raise PycalmError(f"invalid json_schema: {_one_line(str(e))}") from None
        return cls(tok, grammar, "json_schema", vocab_size)

    @classmethod
    def regex(cls, tok: Any, pattern: str, *, vocab_size: int | None = None) -> Constraint:
        """Output that matches the regular expression `pattern` whole (Rust regex syntax)."""
        import llguidance

        if not isinstance(pattern, str) or not pattern:
            raise PycalmError("a regex must be a non-empty string")
        return cls(tok, llguidance.LLMatcher.grammar_from_regex(pattern), "regex", vocab_size)

    @classmethod
    def grammar(cls, tok: Any, lark: str, *, vocab_size: int | None = None) -> Constraint:
        """Output that the Lark grammar `lark` derives from its `start` rule (llguidance's Lark
        dialect: regex terminals, `%json {schema}` for a JSON value, `%ignore`)."""
        import llguidance

        if not isinstance(lark, str) or not lark.strip():
            raise PycalmError("a grammar must be a non-empty string")
        return cls(tok, llguidance.LLMatcher.grammar_from_lark(lark), "grammar", vocab_size)

    # ---- decoding ----------------------------------------------------------------------------

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out` (ceil(vocab_size / 32),) uint32 (a pinned
        buffer, say): bit i % 32 of word i // 32 set where id i may come next. Once finished,
        only the EOS ids."""
        if (
            out.dtype != np.uint32
            or out.shape != (mask_words(self.vocab_size),)
            or not out.flags.c_contiguous
        ):
            raise PycalmError(f"a mask buffer is ({mask_words(self.vocab_size)},) uint32, contiguous")
        out[self._words :] = 0  # ids the tokenizer does not have
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, self._words * 4)
        if self._matcher.is_error():
            raise PycalmError(f"constrained decoding failed: {_one_line(self._matcher.get_error())}")

    def mask(self) -> np.ndarray:
        """The allowed next tokens, (ceil(vocab_size / 32),) uint32 (see fill_mask)."""
        out = np.zeros(mask_words(self.vocab_size), np.uint32)
        self.fill_mask(out)
        return out

    def allowed(self) -> np.ndarray:
        """The allowed next ids, ascending (int64), for tests and messages."""
        bits = np.unpackbits(self.mask().view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.vocab_size])

    def accept(self, token: int) -> None:
        """Move the matcher on by the sampled `token`; a token the mask did not allow is a PycalmError."""
        if token in self.eos_ids and self._matcher.is_accepting():
            self.n_accepted += 1
            return
        if not self._matcher.consume_token(int(token)):
            raise PycalmError(
                f"token {token} does not continue the {self.what} ({_one_line(self._matcher.get_error())})"
            )
        self.n_accepted += 1

    @property
    def finished(self) -> bool:
        """True once the output is complete and nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """True where the output so far is complete (EOS is allowed), even if it may go on."""
        return self._matcher.is_accepting()


def _one_line(message: str) -> str:
    return " ".join(str(message).split())[:300]


def from_response_format(
    tok: Any, response_format: dict | None, *, vocab_size: int | None = None
) -> Constraint | None:
    """The Constraint of an OpenAI `response_format` ({"type": "text"}: None; "json_object": any
    JSON object; "json_schema": {"json_schema": {"schema": {...}, "name", "strict"}}); any other
    type is a PycalmError."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise PycalmError("response_format must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema(tok, None, vocab_size=vocab_size)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise PycalmError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
            )
        return Constraint.json_schema(tok, spec["schema"], vocab_size=vocab_size)
    raise PycalmError(f"response_format type must be text, json_object or json_schema, not {kind!r}")


def make_constraint(
    tok: Any,
    *,
    response_format: dict | None = None,
    grammar: str | None = None,
    regex: str | None = None,
    vocab_size: int | None = None,
) -> Constraint | None:
    """The one Constraint that response_format, grammar and regex ask for (None: none asked);
    more than one is a PycalmError."""
    fmt = from_response_format(tok, response_format, vocab_size=vocab_size)
    asked = [c for c in (fmt is not None, grammar is not None, regex is not None) if c]
    if len(asked) > 1:
        raise PycalmError("give one of response_format (json), grammar and regex, not several")
    if grammar is not None:
        return Constraint.grammar(tok, grammar, vocab_size=vocab_size)
    if regex is not None:
        return Constraint.regex(tok, regex, vocab_size=vocab_size)
    return fmt
