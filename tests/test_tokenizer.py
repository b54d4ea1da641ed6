"""pycalm.model.tokenizer and the GGUF vocabulary conversion (pycalm.convert.gguf) against references
nobody here wrote.

- Real GGUF vocabularies (SmolLM2, Qwen2.5-Coder) turned into tokenizers JSON by
  `tokenizer_json_from_gguf` must give the ids, decodes and chat renderings that transformers'
  own GGUF tokenizer gave (tests/data/tokenizer_*.json, made by scripts/make_tokenizer_golden.py).
- The sentencepiece backend, and the GGUF "llama" (sentencepiece BPE) conversion, are checked
  against sentencepiece itself on a tiny model trained here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import realmodels

from pycalm.convert.gguf import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    gguf_special_ids,
    read_gguf_tokenizer_fields,
    tokenizer_json_from_gguf,
)
from pycalm.errors import PycalmError
from pycalm.model.tokenizer import Tokenizer, chatml

DATA = Path(__file__).parent / "data"
MODELS = {"smollm2": realmodels.smollm2_gguf, "qwen2": realmodels.qwen2_gguf}


# ---- real models ------------------------------------------------------------------------------


@pytest.fixture(scope="session", params=sorted(MODELS))
def real(request: pytest.FixtureRequest) -> tuple[Tokenizer, dict, dict]:
    """(our tokenizer built from the GGUF, the GGUF tokenizer fields, transformers' golden data)."""
    name = request.param
    fields = read_gguf_tokenizer_fields(MODELS[name]())
    bos_id, eos_ids = gguf_special_ids(fields)
    blob = tokenizer_json_from_gguf(fields).encode()
    tok = Tokenizer.from_blob(
        "tokenizers-json", blob, bos_id, eos_ids, fields.get("tokenizer.chat_template", "")
    )
    golden = json.loads((DATA / f"tokenizer_{name}.json").read_text(encoding="utf-8"))
    return tok, fields, golden


def test_encode_matches_transformers(real: tuple[Tokenizer, dict, dict]) -> None:
    tok, _, golden = real
    for case in golden["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]


def test_decode_matches_transformers(real: tuple[Tokenizer, dict, dict]) -> None:
    tok, _, golden = real
    for case in golden["cases"]:
        assert tok.decode(case["ids"]) == case["decoded"], case["text"]
        assert case["decoded"] == case["text"]  # byte-level BPE loses nothing


def test_stream_decode_equals_full_decode(real: tuple[Tokenizer, dict, dict]) -> None:
    tok, _, golden = real
    for case in golden["cases"]:
        stream = tok.stream()
        pieces = [stream.push(i) for i in case["ids"]]
        assert "".join(pieces) + stream.flush() == case["decoded"], case["text"]
        assert not any("\ufffd" in p for p in pieces), case["text"]


def _split_character(tok: Tokenizer) -> tuple[str, list[int]]:
    """A character that this vocabulary spells with more than one token (its bytes split)."""
    for ch in ("🫨", "𝔘", "ꙮ", "🦩", "👋", "🎉", "你"):
        ids = tok.encode(ch, add_bos=False)
        if len(ids) > 1:
            return ch, ids
    raise AssertionError("every candidate character is a single token")


def test_stream_holds_back_partial_characters(real: tuple[Tokenizer, dict, dict]) -> None:
    """A character spread over several tokens appears whole, from the token that completes it."""
    tok, _, _ = real
    ch, ids = _split_character(tok)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == ch
    assert stream.flush() == ""


def test_stream_flush_replaces_unfinished_character(real: tuple[Tokenizer, dict, dict]) -> None:
    tok, _, _ = real
    _, ids = _split_character(tok)
    stream = tok.stream()
    assert stream.push(ids[0]) == ""
    assert stream.flush() == "\ufffd"


def test_chat_template_matches_transformers(real: tuple[Tokenizer, dict, dict]) -> None:
    tok, _, golden = real
    chat = golden["chat"]
    text = tok.apply_chat_template(chat["messages"])
    assert text == chat["text"]
    assert (
        tok.apply_chat_template(chat["messages"], add_generation_prompt=False)
        == chat["text_no_generation_prompt"]
    )
    assert tok.encode(text, add_bos=False) == chat["ids"]


def test_special_tokens_and_sizes(real: tuple[Tokenizer, dict, dict]) -> None:
    tok, fields, _ = real
    assert tok.vocab_size == len(fields["tokenizer.ggml.tokens"])
    assert tok.bos_id == -1  # neither model adds a BOS (add_bos_token false)
    im_start, im_end = tok.encode("<|im_start|><|im_end|>")
    assert tok.eos_ids[0] == im_end
    assert tok.is_special(im_start) and tok.is_special(im_end)
    assert not tok.is_special(tok.encode("hello")[0])
    assert tok.token_text(im_end) == "<|im_end|>"


def test_gguf_special_ids() -> None:
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    assert gguf_special_ids(fields) == (1, (2,))  # sentencepiece vocabularies add BOS unless told not to
    fields.update({"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.eot_token_id": 7})
    assert gguf_special_ids(fields) == (-1, (2, 7))
    gpt2 = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    assert gguf_special_ids(gpt2) == (-1, (0,))


# ---- errors -----------------------------------------------------------------------------------

TINY_GPT2 = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "<|eot|>"],
    "tokenizer.ggml.token_type": [1, 1, 1, 1, 3],
    "tokenizer.ggml.merges": ["a b"],
}


def test_tiny_gpt2_vocabulary() -> None:
    tok = Tokenizer.from_blob("tokenizers-json", tokenizer_json_from_gguf(TINY_GPT2).encode(), -1, (4,))
    assert tok.encode("ab a<|eot|>") == [2, 3, 0, 4]
    assert tok.decode([2, 3, 0, 4]) == "ab a<|eot|>"
    assert tok.is_special(4) and not tok.is_special(2)


def test_unknown_pre_tokenizer_is_named() -> None:
    with pytest.raises(PycalmError, match="'mystery-pre'"):
        tokenizer_json_from_gguf({**TINY_GPT2, "tokenizer.ggml.pre": "mystery-pre"})


def test_unknown_model_and_missing_fields() -> None:
    with pytest.raises(PycalmError, match="'rwkv'"):
        tokenizer_json_from_gguf({**TINY_GPT2, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(PycalmError, match="no tokenizer"):
        tokenizer_json_from_gguf({})
    with pytest.raises(PycalmError, match="merges"):
        tokenizer_json_from_gguf({k: v for k, v in TINY_GPT2.items() if k != "tokenizer.ggml.merges"})


def test_bad_blobs() -> None:
    with pytest.raises(PycalmError, match="unknown tokenizer kind"):
        Tokenizer.from_blob("bpe", b"", -1, ())
    with pytest.raises(PycalmError, match="tokenizers JSON is corrupt"):
        Tokenizer.from_blob("tokenizers-json", b"{not json", -1, ())
    with pytest.raises(PycalmError, match="sentencepiece tokenizer is corrupt"):
        Tokenizer.from_blob("sentencepiece", b"\x00garbage\xff", -1, ())
    with pytest.raises(PycalmError, match="not found"):
        read_gguf_tokenizer_fields("/nonexistent/model.gguf")


def test_gguf_metadata_reader_errors(tmp_path: Path) -> None:
    smollm2 = realmodels.smollm2_gguf()
    with open(smollm2, "rb") as f:
        head = f.read(1 << 20)  # cut inside the vocabulary array
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(head)
    with pytest.raises(
        PycalmError,
        match=r"truncated.gguf: not a readable GGUF file, truncated or corrupt \(an array of 48900 values runs past",
    ):
        read_gguf_tokenizer_fields(truncated)
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(PycalmError, match="bad magic"):
        read_gguf_tokenizer_fields(not_gguf)
    fields = read_gguf_tokenizer_fields(smollm2)
    assert fields["tokenizer.ggml.pre"] == "smollm" and fields["tokenizer.ggml.add_bos_token"] is False
    assert (
        len(fields["tokenizer.ggml.merges"]) == 48900 and fields["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    )


# ---- chat templates ---------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_chatml_fallback() -> None:
    tok = Tokenizer.from_blob("tokenizers-json", tokenizer_json_from_gguf(TINY_GPT2).encode(), -1, (4,))
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(MESSAGES) == expected == chatml(MESSAGES, True)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_template_features() -> None:
    """trim_blocks / lstrip_blocks, bos/eos variables, raise_exception -> PycalmError."""
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
        "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer.from_blob(
        "tokenizers-json", tokenizer_json_from_gguf(TINY_GPT2).encode(), 2, (4,), template
    )
    assert tok.apply_chat_template(MESSAGES) == "ab\n[system] Be brief.<|eot|>\n[user] hi<|eot|>\n[assistant]"
    with pytest.raises(PycalmError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    bad = Tokenizer.from_blob(
        "tokenizers-json", tokenizer_json_from_gguf(TINY_GPT2).encode(), -1, (4,), "{% if %}"
    )
    with pytest.raises(PycalmError, match="chat template"):
        bad.apply_chat_template(MESSAGES)


# ---- sentencepiece ----------------------------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer splits text into pieces that a model can read.",
    "Numbers like 12 and 345 appear in text, and so do names like Ada and Alan.",
    "She sells sea shells by the sea shore, and the shells she sells are sea shells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "Peter Piper picked a peck of pickled peppers.",
]
TEXTS = [
    "the quick brown fox",
    "  two leading spaces and   runs",
    "unseen: 你好 👋🏽 é",
    "<s>bos in text</s> and after",
    "line\nbreak",
    "",
]


def _train(tmp_path: Path, model_type: str) -> bytes:
    import sentencepiece as spm

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(CORPUS * 20), encoding="utf-8")
    prefix = tmp_path / f"tiny_{model_type}"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        model_type=model_type,
        vocab_size=330,  # 256 byte pieces + 3 specials + ~70 learned pieces
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        # as Llama-family models are trained: the text is kept as is (no NFKC, spaces untouched)
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return Path(f"{prefix}.model").read_bytes()


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("spm")
    return {"unigram": _train(tmp, "unigram"), "bpe": _train(tmp, "bpe")}


def _processor(blob: bytes):  # noqa: ANN202 - sentencepiece has no type stubs
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(blob)
    return sp


@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_sentencepiece_backend(spm_models: dict[str, bytes], model_type: str) -> None:
    blob = spm_models[model_type]
    sp = _processor(blob)
    tok = Tokenizer.from_blob("sentencepiece", blob, sp.bos_id(), (sp.eos_id(),))
    assert tok.vocab_size == sp.get_piece_size()
    for text in TEXTS:
        if "<s>" in text:
            # control tokens written in the text become their ids; the text between is encoded as is
            expected = (
                [sp.bos_id(), sp.bos_id()]
                + sp.encode("bos in text")
                + [sp.eos_id()]
                + sp.encode(" and after")
            )
        else:
            expected = [sp.bos_id()] + sp.encode(text)
        ids = tok.encode(text)
        assert ids == expected, text
        assert tok.encode(text, add_bos=False) == expected[1:]
        assert tok.decode(ids) == sp.decode(ids)
        stream = tok.stream()
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == sp.decode(ids), text
        assert not any("\ufffd" in p for p in pieces)
    # byte fallback really happened: the emoji is not in the vocabulary
    emoji_ids = sp.encode("👋")
    assert all(sp.is_byte(i) for i in emoji_ids if sp.id_to_piece(i) != "\u2581")
    assert tok.is_special(sp.bos_id()) and tok.is_special(sp.eos_id())


def _spm_as_gguf_fields(blob: bytes) -> dict:
    """The fields llama.cpp's converter writes for a sentencepiece model."""
    sp = _processor(blob)
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(TOKEN_UNKNOWN)
        elif sp.is_control(i):
            types.append(TOKEN_CONTROL)
        elif sp.is_byte(i):
            types.append(TOKEN_BYTE)
        else:
            types.append(TOKEN_NORMAL)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }


def test_gguf_llama_vocabulary_matches_sentencepiece(spm_models: dict[str, bytes]) -> None:
    """A sentencepiece BPE vocabulary stored GGUF-style (scores, no merges) encodes as sentencepiece does."""
    blob = spm_models["bpe"]
    sp = _processor(blob)
    fields = _spm_as_gguf_fields(blob)
    bos_id, eos_ids = gguf_special_ids(fields)
    assert (bos_id, eos_ids) == (sp.bos_id(), (sp.eos_id(),))
    tok = Tokenizer.from_blob("tokenizers-json", tokenizer_json_from_gguf(fields).encode(), bos_id, eos_ids)
    for text in TEXTS + CORPUS:
        ids = tok.encode(text)
        if "<s>" in text:
            # as llama.cpp: control tokens whole, and a space put in front of the text after each
            expected = (
                [sp.bos_id(), sp.bos_id()]
                + sp.encode("bos in text")
                + [sp.eos_id()]
                + sp.encode(" and after")
            )
            assert ids == expected
            # transformers' decode keeps special tokens; the leading space is only dropped at the start
            assert tok.decode(ids) == "<s><s> bos in text</s>  and after"
        else:
            assert ids == [sp.bos_id()] + sp.encode(text), text
            assert tok.decode(ids[1:]) == sp.decode(ids), text
        stream = tok.stream()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids), text


def test_stream_with_metaspace_decoder(spm_models: dict[str, bytes]) -> None:
    """tokenizers JSON files that decode with Metaspace (not Replace + Strip) stream the same text."""
    fields = _spm_as_gguf_fields(spm_models["bpe"])
    data = json.loads(tokenizer_json_from_gguf(fields))
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        ],
    }
    tok = Tokenizer.from_blob("tokenizers-json", json.dumps(data).encode(), -1, (2,))
    for text in TEXTS:
        if "<s>" in text:
            continue
        ids = tok.encode(text)
        assert tok.decode(ids) == text, text
        stream = tok.stream()
        assert "".join(stream.push(i) for i in ids) + stream.flush() == text, text


def test_byte_level_pieces_fast_and_slow_paths() -> None:
    # GPT-2's alphabet: 'Ġ' is the space byte, 'Ċ' the newline, 'ÃŃ' the two bytes of 'í'
    from pycalm.model.tokenizer import _byte_level_pieces

    plain = ["Ġthe", "Ċ", "ÃŃ", "", "!"]
    assert _byte_level_pieces(plain) == [b" the", b"\n", "í".encode(), b"", b"!"]
    # a character outside the alphabet (here U+20AC, U+201A) is dropped (the slow path), and the
    # pieces after it keep their places
    assert _byte_level_pieces(["a\u201a", "\u20acb", "c"]) == [b"a", b"b", b"c"]
    # a piece holding the joiner U+FFFF itself must not shift the pieces after it
    assert _byte_level_pieces(["x\uffffy", "Ġz"]) == [b"xy", b" z"]
    # characters below 256 outside the alphabet (controls, the raw space) are dropped too
    assert _byte_level_pieces(["a b\nc"]) == [b"abc"]
