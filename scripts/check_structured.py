"""Structured output on a real model: 20 JSON schemas, N samples each at temperature 0.7, every
output parsed and validated against its schema (jsonschema). Prints the count that is valid.

    python scripts/check_structured.py [MODEL ...] [--samples 5] [--max-tokens 200] [--device auto]

MODEL defaults to SmolLM2-135M-Instruct; give Qwen2.5-Coder-0.5B's GGUF (or any model) too. An
output cut off at --max-tokens counts as invalid (finish_reason "length").
"""

from __future__ import annotations

import argparse
import json
import time

S = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}),
    ("a city", {"type": "object", "properties": {"city": S, "country": S, "population": {"type": "integer"}}, "required": ["city", "country"], "additionalProperties": False}),
    ("a yes/no answer", {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"], "additionalProperties": False}),
    ("three colours", {"type": "array", "items": S, "minItems": 3, "maxItems": 3}),
    ("a book", {"type": "object", "properties": {"title": S, "author": S, "year": {"type": "integer"}}, "required": ["title", "author", "year"], "additionalProperties": False}),
    ("a point", {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}),
    ("a todo item", {"type": "object", "properties": {"task": S, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}}, "required": ["task", "done", "priority"], "additionalProperties": False}),
    ("a list of up to 4 numbers", {"type": "array", "items": {"type": "integer"}, "maxItems": 4}),
    ("a product", {"type": "object", "properties": {"name": S, "price": {"type": "number", "minimum": 0}, "tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["name", "price", "tags"], "additionalProperties": False}),
    ("a date", {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}, "month": {"type": "integer", "minimum": 1, "maximum": 12}, "day": {"type": "integer", "minimum": 1, "maximum": 31}}, "required": ["year", "month", "day"], "additionalProperties": False}),
    ("a sentiment", {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}}, "required": ["sentiment"], "additionalProperties": False}),
    ("an email", {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}, "required": ["email"], "additionalProperties": False}),
    ("a pet", {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "name": S, "legs": {"type": "integer", "minimum": 0, "maximum": 4}}, "required": ["kind", "name", "legs"], "additionalProperties": False}),
    ("a nested address", {"type": "object", "properties": {"name": S, "address": {"type": "object", "properties": {"street": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"], "additionalProperties": False}}, "required": ["name", "address"], "additionalProperties": False}),
    ("a boolean", {"type": "boolean"}),
    ("a score", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a word", {"type": "string", "pattern": "^[a-z]{2,8}$"}),
    ("two people", {"type": "array", "items": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"], "additionalProperties": False}, "minItems": 2, "maxItems": 2}),
    ("a weather report", {"type": "object", "properties": {"temperature": {"type": "number"}, "unit": {"enum": ["C", "F"]}, "rain": {"type": "boolean"}}, "required": ["temperature", "unit", "rain"], "additionalProperties": False}),
    ("a key and an optional note", {"type": "object", "properties": {"key": {"type": "string", "pattern": "^[A-Z]{3}$"}, "note": S}, "required": ["key"], "additionalProperties": False}),
]  # fmt: skip


def check(model: str | None, samples: int, max_tokens: int, device: str) -> tuple[int, int]:
    import jsonschema

    import pycalm

    llm = pycalm.load(model, device=device, context=1024, verbose=False)
    valid = total = 0
    t0 = time.perf_counter()
    for i, (what, schema) in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": f"Reply with {what} as JSON."}]
        for seed in range(samples):
            gen = llm.chat(messages, max_tokens=max_tokens, temperature=0.7, top_p=1.0, seed=seed,
                           response_format=fmt, stream=True)  # fmt: skip
            text = "".join(gen)
            total += 1
            try:
                jsonschema.validate(json.loads(text), schema)
                ok = gen.finish_reason == "stop"
            except (ValueError, jsonschema.ValidationError):
                ok = False
            valid += ok
            if not ok:
                print(f"  INVALID {what!r} seed {seed} ({gen.finish_reason}): {text[:200]!r}")
        print(f"{llm.name}: {i + 1:2d}/{len(SCHEMAS)} {what:28s} {valid}/{total} valid "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    return valid, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=[None])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    for model in args.models:
        valid, total = check(model, args.samples, args.max_tokens, args.device)
        print(f"{model or 'SmolLM2-135M-Instruct'}: {valid}/{total} valid ({100 * valid / total:.0f}%)")


if __name__ == "__main__":
    main()
