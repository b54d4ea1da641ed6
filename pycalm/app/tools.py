"""Tool calling: the tools a chat offers, rendered by the model's own chat template, and the
calls parsed back out of the model's text.

A tool is OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}
(parameters: a JSON schema); a call is OpenAI's {"id", "type": "function", "function": {"name",
"arguments"}} with the arguments as JSON text. Chat templates get the tools as `tools=` (the
transformers convention) and a call's arguments as an object, as transformers passes them.

How a model writes a call is its own; pycalm reads it from the chat template, once a model, for
tool_choice "required" and named calls (tool_grammar forces that form):

  hermes   <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>, one or more, maybe
           after some text (Qwen2.5, Hermes and the many templates that copy them).
  llama3   the whole reply is {"name": NAME, "parameters": {...}}, maybe after <|python_tag|>,
           several joined by ";" (Llama 3.1, 3.2: their templates speak of "parameters" and
           the "ipython" role).

The parser (ToolCallParser) reads both forms whatever the model's, since models stray (Qwen2.5-
Coder often writes a bare JSON call without its tags).

A template that never mentions `tools` gets the hermes form all the same: pycalm writes the tools
into the system message in Qwen2.5's words, and turns the conversation's calls and results into
text (an assistant turn holding <tool_call> blocks, a user turn holding <tool_response> blocks).

Text that looks like a call but does not parse as one (bad JSON, no name) stays the reply's text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pycalm.errors import PycalmError

TOOL_FORMATS = ("hermes", "llama3")
CALL_START, CALL_END = "<tool_call>", "</tool_call>"  # hermes
PYTHON_TAG = "<|python_tag|>"  # llama3: a reply that is code or a call may start with it
TOOL_CHOICES = ("auto", "none", "required")  # or {"type": "function", "function": {"name": NAME}}


def tool_format(template: str) -> str:
    """The tool-call form a chat template teaches its model: llama3 or hermes (the default)."""
    if CALL_START not in template and (
        PYTHON_TAG in template or ("ipython" in template and '"parameters' in template)
    ):
        return "llama3"
    return "hermes"


def template_knows_tools(template: str) -> bool:
    """Whether the template renders `tools` itself (else pycalm writes them in, hermes-style)."""
    return "tools" in template


# ---- checking what a request gives ----------------------------------------------------------


def check_tools(tools: object) -> list[dict]:
    """OpenAI's tools list, checked: each {"type": "function", "function": {"name": str, ...}}
    with object parameters where given."""
    if not isinstance(tools, list):
        raise PycalmError("tools must be a list of {'type': 'function', 'function': {...}}")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise PycalmError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise PycalmError(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise PycalmError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        if fn["name"] in names:
            raise PycalmError(f"tools[{i}]: the name {fn['name']!r} is given twice")
        names.add(fn["name"])
    return tools


def check_tool_choice(choice: object, tools: list[dict] | None) -> str:
    """ "auto", "none", "required" or the named function's name, checked against the tools."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise PycalmError(
                "tool_choice must be auto, none, required or {'type': 'function', 'function': {'name': NAME}}"
            )
        if name not in {t["function"]["name"] for t in tools or []}:
            raise PycalmError(f"tool_choice names {name!r}, which is not among the tools")
        return name
    if choice not in TOOL_CHOICES:
        raise PycalmError(f"tool_choice must be auto, none, required or a named function, not {choice!r}")
    if choice == "required" and not tools:
        raise PycalmError("tool_choice 'required' needs tools")
    return choice


# ---- rendering: what the template gets --------------------------------------------------------


def new_call(name: str, arguments: dict | str) -> dict:
    """An OpenAI tool call with a fresh id; arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _arguments_object(arguments: object) -> object:
    """A call's arguments as templates want them: an object (OpenAI sends JSON text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict] | None, knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The messages and tools to render: a call's arguments as an object; for a template that
    does not know tools, the tools described in the system message and the calls and results
    written as hermes text (then no tools are passed)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])},
                }
                for c in m["tool_calls"]
            ]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if knows_tools:
        return out, tools or None
    return _as_hermes_text(out, tools or []), None


def hermes_system(tools: list[dict]) -> str:
    """The tools' part of the system message, in Qwen2.5's words (its template's text)."""
    listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _as_hermes_text(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    if tools:
        system = hermes_system(tools)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_result"):  # results in a row share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_result": True})
        elif m.get("tool_calls"):
            calls = [
                CALL_START
                + "\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n"
                + CALL_END
                for c in m["tool_calls"]
            ]
            out.append(
                {"role": "assistant", "content": "\n".join([m["content"]] * bool(m["content"]) + calls)}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{"role": m["role"], "content": m["content"]} for m in out]


# ---- parsing: the reply's text and calls -------------------------------------------------------


def _call_of(obj: object, names: frozenset[str] | None) -> dict | None:
    """The call an object spells ({"name", "arguments" or "parameters"}), or None; with `names`,
    only a call of one of them."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments given as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return new_call(obj["name"], args)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class ToolCallParser:
    """The reply's text in, as it is made: ("content", text) and ("call", call) events out.

    Two forms are read whatever the model's format, since models stray into the other one
    (Qwen2.5-Coder often writes a bare JSON call without its <tool_call> tags):
    - a reply whose first visible text is "{" or <|python_tag|> is held whole and read at the end
      as JSON calls joined by ";" (llama3's form); with `names`, only calls of those tools count.
      Anything else it holds (a JSON answer) is content after all, handed out at the end.
    - otherwise the text is content until <tool_call>; the block is held until </tool_call> (or
      the end) and is a call if its JSON spells one (of any name), else content again.
      Whitespace between and after calls is layout, not content."""

    names: frozenset[str] | None = None  # the offered tools' names (None: any)
    pending: str = ""  # text not handed out yet
    reply: str | None = None  # "calls" (held to the end) or "text", once the reply shows which
    in_call: bool = False  # text: inside a <tool_call> block
    calls: list[dict] = field(default_factory=list)

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        return self._read(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        """The events the end of the reply completes (a held block, a held JSON reply)."""
        return self._read(final=True)

    def _read(self, final: bool) -> list[tuple[str, Any]]:
        if self.reply is None:  # only whitespace so far, or maybe the tag's beginning
            start = self.pending.lstrip()
            if start.startswith("{") or start.startswith(PYTHON_TAG):
                self.reply = "calls"
            elif start and not (PYTHON_TAG.startswith(start) and not final):
                self.reply = "text"
            elif not final:
                return []
        if self.reply == "calls":
            if not final:
                return []
            text, self.pending = self.pending, ""
            calls = _parse_json_calls(text.lstrip().removeprefix(PYTHON_TAG), self.names)
            if calls is None:
                return [("content", text)]
            out = []
            for call in calls:
                out += self._call(call)
            return out
        return self._tagged(final)

    def _content(self, text: str) -> list[tuple[str, Any]]:
        if not text or (self.calls and not text.strip()):
            return []
        return [("content", text)]

    def _call(self, call: dict) -> list[tuple[str, Any]]:
        self.calls.append(call)
        return [("call", call)]

    def _tagged(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while True:
            if not self.in_call:
                at = self.pending.find(CALL_START)
                if at >= 0:
                    out += self._content(self.pending[:at])
                    self.pending, self.in_call = self.pending[at + len(CALL_START) :], True
                    continue
                keep = 0 if final else _held(self.pending, CALL_START)
                if self.calls and not final and not self.pending.strip():
                    keep = len(self.pending)  # whitespace after a call: layout unless text follows
                out += self._content(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return out
            end = self.pending.find(CALL_END)
            if end < 0 and not final:
                return out
            body = self.pending if end < 0 else self.pending[:end]
            rest = "" if end < 0 else self.pending[end + len(CALL_END) :]
            calls = _parse_json_calls(body, None)
            if calls is not None and len(calls) == 1:
                out += self._call(calls[0])
            else:  # not a call: the block is text after all
                out += [("content", CALL_START + body + ("" if end < 0 else CALL_END))]
            self.pending, self.in_call = rest, False


def _parse_json_calls(text: str, names: frozenset[str] | None) -> list[dict] | None:
    """Calls written as JSON objects joined by ";" (and spaces), or None if that is not all."""
    decoder = json.JSONDecoder()
    calls, at = [], 0
    text = text.strip()
    while at < len(text):
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        if (call := _call_of(obj, names)) is None:
            return None
        calls.append(call)
        while at < len(text) and text[at] in "; \n\t":
            at += 1
    return calls or None


def reply_message(content: str, calls: list[dict] | None) -> dict[str, Any]:
    """The assistant's message in OpenAI's shape: content (None when only calls were made) and
    tool_calls (only when there are some): what the next turn's messages take as it is."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content.strip() or None
        message["tool_calls"] = calls
    return message


# ---- required and named calls: a grammar of the model's own call syntax -----------------------

# the JSON of a forced call: on one line, ", " and ": " between items (no free whitespace, which
# a model can repeat without end), as pycalm.app.constrain writes JSON schemas
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_grammar(fmt: str, tools: list[dict], choice: str) -> str:
    """The Lark grammar (llguidance's dialect, pycalm.app.constrain) that forces tool calls in the
    model's own form: for "required", one or more calls of any of the tools; for a tool's name,
    one call of it. A call is the JSON {"name": NAME, "arguments" (llama3: "parameters"): an
    object valid against the tool's parameters schema}, inside <tool_call> tags for hermes."""
    key = "parameters" if fmt == "llama3" else "arguments"
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: f.get("parameters") or {"type": "object"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": _JSON_LAYOUT}
    lines = [f"call_json: %json {json.dumps(schema)}"]
    if fmt == "llama3":
        lines.append("call: call_json")
        more = '"; " call'
    else:
        lines.append(f"call: {json.dumps(CALL_START + chr(10))} call_json {json.dumps(chr(10) + CALL_END)}")
        more = '"\\n" call'
    lines.insert(0, "start: call" + (f" ({more})*" if choice == "required" else ""))
    return "\n".join(lines) + "\n"
