"""Tool calling (pycalm.app.tools): the calls parsed out of a reply, streamed or whole; the tools
and the conversation's calls and results rendered by the real models' chat templates; the Python
API on a scripted engine; and, end to end, the server on the real Qwen2.5-Coder-0.5B-Instruct
driven by the openai client: the model calls the tool, and a turn carrying the result gets text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from pycalm.app.api import LLM
from pycalm.app.tools import (
    ToolCallParser,
    check_tool_choice,
    template_knows_tools,
    template_messages,
    tool_format,
)
from pycalm.errors import PycalmError
from pycalm.model.tokenizer import chatml, render_chat_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _parse(text: str, pieces: int = 1, names: frozenset[str] | None = None) -> tuple[list, list[str]]:
    """(calls as (name, arguments object), the content pieces) of `text` pushed in `pieces`-long
    bits (1: a character at a time, as a stream of one-character tokens would)."""
    parser = ToolCallParser(names)
    events = []
    for at in range(0, len(text), pieces):
        events += parser.push(text[at : at + pieces])
    events += parser.finish()
    calls = [
        (v["function"]["name"], json.loads(v["function"]["arguments"])) for k, v in events if k == "call"
    ]
    for k, v in events:
        if k == "call":
            assert v["type"] == "function" and v["id"].startswith("call_")
    assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls]
    return calls, [v for k, v in events if k == "content"]


# ---- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_hermes_calls(pieces):
    """Qwen2.5's form: one call, several (whitespace between them is no content), text before."""
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _parse(one, pieces) == ([("get_weather", {"city": "Paris"})], [])
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    assert _parse(two, pieces) == ([("get_weather", {"city": "Paris"}), ("get_time", {})], [])
    calls, content = _parse("Let me look.\n" + one, pieces)
    assert calls == [("get_weather", {"city": "Paris"})] and "".join(content) == "Let me look.\n"
    # a block the end of the reply cuts before its closing tag still counts when its JSON is whole
    assert _parse(one.removesuffix("</tool_call>"), pieces)[0] == [("get_weather", {"city": "Paris"})]
    # arguments given as JSON text, as some models write them
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    assert _parse(text, pieces) == ([("f", {"x": [1, 2]})], [])


@pytest.mark.parametrize("pieces", [1, 4, 1000])
def test_llama3_and_bare_json_calls(pieces):
    """Llama 3.1's form ({"name", "parameters"}, maybe after <|python_tag|>, several joined by
    ";") and a bare JSON call (Qwen2.5-Coder drops its tags), of the offered tools only."""
    names = frozenset({"get_weather", "get_time"})
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _parse(text, pieces, names) == ([("get_weather", {"city": "Paris"})], [])
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert _parse(text, pieces, names) == ([("get_weather", {"city": "Oslo"}), ("get_time", {})], [])
    text = ' \n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert _parse(text, pieces, names) == ([("get_weather", {"city": "Rome"})], [])
    # JSON that is no call of an offered tool is the reply's text, whole
    for text in (
        '{"name": "rm_rf", "arguments": {}}',
        '{"answer": 42}',
        '{"name": "get_time", "parameters": {}} and more',
    ):
        assert _parse(text, pieces, names) == ([], [text])


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_malformed_calls_stay_content(pieces):
    cases = [
        "The weather is fine.",
        "Use <tool_call> tags like <tool_ and so on.",  # a start with no JSON call in it
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments no object
        '{"name": "get_weather", "arguments": {"city": ',  # a JSON reply cut short
        "<|python_tag|>print('hi')",
        "<|python",  # maybe the tag's start, then the end
        "",
    ]
    for text in cases:
        calls, content = _parse(text, pieces)
        assert calls == [] and "".join(content) == text, text
    # a malformed block between two calls is text, the calls still count
    good = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    calls, content = _parse(good + "<tool_call>oops</tool_call>" + good, pieces)
    assert calls == [("a", {}), ("a", {})] and "".join(content) == "<tool_call>oops</tool_call>"


def test_text_streams_before_a_call():
    """Content goes out as it comes, but for an end that could begin <tool_call>."""
    parser = ToolCallParser()
    assert parser.push("Sure, <tool") == [("content", "Sure, ")]
    assert parser.push("_call>\n{") == []
    assert [k for k, _ in parser.push('"name": "f", "arguments": {}}\n</tool_call>')] == ["call"]
    assert parser.push("\n") == [] and parser.finish() == []


def test_tool_choice_and_format_checks():
    assert check_tool_choice(None, [WEATHER]) == "auto" and check_tool_choice(None, None) == "none"
    assert (
        check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, [WEATHER])
        == "get_weather"
    )
    with pytest.raises(PycalmError, match="not among the tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, [WEATHER])
    with pytest.raises(PycalmError, match="tool_choice must be"):
        check_tool_choice("sometimes", [WEATHER])
    with pytest.raises(PycalmError, match="needs tools"):
        check_tool_choice("required", None)
    assert tool_format(LLAMA3_LIKE) == "llama3" and tool_format(chatml([], True)) == "hermes"


# ---- rendering ---------------------------------------------------------------------------------

# a template in Llama 3.1's tool layout (written here: no Llama model is at hand): the tools as
# JSON in the first user turn, a call as {"name", "parameters"}, a result in the ipython role
LLAMA3_LIKE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif 'tool_calls' in m %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{{ \'{"name": "\' + m.tool_calls[0].function.name + \'", "parameters": \' }}'
    "{{- m.tool_calls[0].function.arguments | tojson }}}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if loop.first and tools is defined and tools %}Given the following functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TURNS = [
    *QUESTION,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_llama3_layout_renders_tools_and_calls():
    messages, tools = template_messages(TURNS, [WEATHER], template_knows_tools(LLAMA3_LIKE))
    text = render_chat_template(LLAMA3_LIKE, messages, True, "<s>", "</s>", tools)
    assert text == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions:\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\nWhat is the weather like in Paris today?<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n18 C, sunny<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert TURNS[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not changed


def test_template_without_tools_gets_them_hermes_style():
    """ChatML with no tools of its own (SmolLM2's layout): the tools in the system message, the
    call and the result as <tool_call> and <tool_response> text."""
    messages, tools = template_messages(
        [{"role": "system", "content": "Be brief."}, *TURNS], [WEATHER], knows_tools=False
    )
    assert tools is None
    text = chatml(messages, True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_real_templates_render_tools(qwen_tok, smollm2_gguf_path):
    """The GGUFs' own templates: Qwen2.5's lists the tools and writes the call and the result in
    its tags; SmolLM2's knows no tools, so pycalm writes them in."""
    from pycalm.convert.gguf import read_gguf_tokenizer_fields

    qwen = qwen_tok.chat_template
    smol = read_gguf_tokenizer_fields(smollm2_gguf_path)["tokenizer.chat_template"]
    assert tool_format(qwen) == "hermes" and template_knows_tools(qwen) and not template_knows_tools(smol)
    messages, tools = template_messages(TURNS, [WEATHER, TIME], True)
    text = render_chat_template(qwen, messages, True, "", "<|im_end|>", tools)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER)
        + "\n"
        + json.dumps(TIME)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within"
        ' <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # pycalm's hermes system text is Qwen's own wording
    messages, _ = template_messages(QUESTION, [WEATHER, TIME], False)
    assert messages[0]["content"] in text
    messages, _ = template_messages(TURNS, [WEATHER], False)
    text = render_chat_template(smol, messages, True, "", "<|im_end|>")
    assert "<tools>\n" + json.dumps(WEATHER) in text and "<tool_response>\n18 C, sunny\n" in text


@pytest.fixture(scope="module")
def qwen_tok(qwen2_gguf_path):
    """Qwen2.5-Coder's tokenizer and chat template, from its GGUF."""
    from pycalm.convert.gguf import gguf_special_ids, read_gguf_tokenizer_fields, tokenizer_json_from_gguf
    from pycalm.model.tokenizer import Tokenizer

    fields = read_gguf_tokenizer_fields(qwen2_gguf_path)
    bos_id, eos_ids = gguf_special_ids(fields)
    blob = tokenizer_json_from_gguf(fields).encode()
    return Tokenizer.from_blob("tokenizers-json", blob, bos_id, eos_ids, fields["tokenizer.chat_template"])


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_tool_grammar_forces_the_model_form(qwen_tok, fmt):
    """required and named: the grammar takes the model's own call text token by token (one call,
    or several for required), and refuses another tool's name, arguments that break the schema,
    free whitespace and text before the call."""
    from pycalm.app.constrain import Constraint
    from pycalm.app.tools import tool_grammar

    tok = qwen_tok
    key, wrap, sep = (
        ("arguments", "<tool_call>\n{}\n</tool_call>", "\n")
        if fmt == "hermes"
        else ("parameters", "{}", "; ")
    )
    weather = wrap.format(f'{{"name": "get_weather", "{key}": {{"city": "Paris"}}}}')
    clock = wrap.format(f'{{"name": "get_time", "{key}": {{}}}}')

    def follows(choice: str, text: str) -> tuple[bool, bool]:
        """(every token of `text` allowed, the output complete after it)"""
        c = Constraint.grammar(tok, tool_grammar(fmt, [WEATHER, TIME], choice))
        for t in tok.encode(text, add_bos=False):
            if t not in set(c.allowed().tolist()):
                return False, False
            c.accept(t)
        return True, c.accepting

    assert follows("get_weather", weather) == (True, True)
    assert follows("required", weather) == (True, True)
    assert follows("required", weather + sep + clock) == (True, True)
    assert follows("get_weather", weather + sep + clock)[0] is False  # one call of the named tool
    assert follows("get_time", weather)[0] is False
    assert follows("required", weather.replace('"Paris"', "12"))[0] is False  # city is a string
    assert follows("required", weather.replace(": ", ":  ", 1))[0] is False
    assert follows("required", "Sure! " + weather)[0] is False


# ---- the Python API on a scripted engine -------------------------------------------------------


class CharTokenizer:
    """A token a character (id = code point): every hold-back is exercised at each character."""

    chat_template = ""

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None) -> str:
        return chatml(messages, add_generation_prompt)

    def stream(self) -> object:
        class Decoder:
            def push(self, t: int) -> str:
                return chr(t)

            def flush(self) -> str:
                return ""

        return Decoder()


EOS = 0


@dataclass
class Config:
    eos_ids: tuple[int, ...] = (EOS,)
    vocab_size: int = 0x110000  # the character tokenizer's ids


class ScriptedEngine:
    """Answers any prompt with `reply`, then the EOS."""

    def __init__(self, reply: str) -> None:
        self.reply, self.config, self.seq_len, self.device = reply, Config(), 100_000, "cpu"
        self.prompts: list[list[int]] = []

    def generate(self, ids, start_pos, max_tokens, sampling, **options):
        self.prompts.append(list(ids))
        yield from ([ord(c) for c in self.reply] + [EOS])[:max_tokens]


def test_llm_chat_with_tools():
    reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = ScriptedEngine(reply)
    llm = LLM(engine, CharTokenizer())
    message = llm.chat(QUESTION, tools=[WEATHER], max_tokens=200, temperature=0)
    assert message["role"] == "assistant" and message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    prompt = "".join(map(chr, engine.prompts[-1]))
    assert "<tools>\n" + json.dumps(WEATHER) in prompt  # the tools were offered
    # streamed: the text pieces, and the call once complete; finish_reason tool_calls
    gen = llm.chat(QUESTION, tools=[WEATHER], max_tokens=200, temperature=0, stream=True)
    assert "".join(gen) == "Checking." and gen.finish_reason == "tool_calls"
    assert gen.tool_calls[0]["function"] == call["function"] and gen.message["content"] == "Checking."
    # the next turn takes the message as it is, and the result
    turns = [*QUESTION, message, {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]
    llm.chat(turns, tools=[WEATHER], max_tokens=1)
    assert "<tool_response>\n18 C\n</tool_response>" in "".join(map(chr, engine.prompts[-1]))
    # tool_choice none: no tools offered, nothing parsed
    message = llm.chat(QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=200)
    assert message == {"role": "assistant", "content": reply} and "<tools>" not in "".join(
        map(chr, engine.prompts[-1])
    )
    # cut by max_tokens inside the call: text, finish length
    gen = llm.chat(QUESTION, tools=[WEATHER], max_tokens=30, stream=True)
    assert "".join(gen) == reply[:30] and gen.finish_reason == "length" and gen.tool_calls == []
    # without tools: a string, as before
    assert llm.chat(QUESTION, max_tokens=9) == "Checking."
    with pytest.raises(PycalmError, match="tool_choice needs tools"):
        llm.chat(QUESTION, tool_choice="auto")


# ---- end to end: the server on the real Qwen2.5-Coder-0.5B-Instruct ----------------------------


@pytest.fixture(scope="module")
def qwen_server(qwen2_fp16, tmp_path_factory):
    from test_serve import cpu_server

    with cpu_server(
        qwen2_fp16, tmp_path_factory.mktemp("tools_serve") / "server.log", 1024, seconds=120
    ) as url:
        yield url


def test_server_tool_call_and_result(qwen_server):
    """auto: the model calls get_weather (greedy), streamed the same; the next turns carry the
    call and its result, and the model answers in words. required and named force calls where
    the model would not call."""
    import openai

    client = openai.OpenAI(base_url=qwen_server + "/v1", api_key="unused", max_retries=0, timeout=120)
    greedy = {"model": "m", "tools": [WEATHER], "temperature": 0, "max_tokens": 30}
    first = client.chat.completions.create(messages=QUESTION, **greedy).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    [call] = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # streamed: no content, one tool_calls delta with the whole call, finish_reason tool_calls
    chunks = list(client.chat.completions.create(messages=QUESTION, stream=True, **greedy))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    [streamed] = [t for d in deltas for t in d.tool_calls or []]
    assert streamed.index == 0 and streamed.id.startswith("call_") and streamed.type == "function"
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the second turn: the call, its result (and, for this 0.5B model, which otherwise calls the
    # tool again, the question asked once more) give a text answer that uses the result
    turns = [
        *QUESTION,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
        {"role": "user", "content": "So, what is the weather in Paris? Answer in words."},
    ]
    second = client.chat.completions.create(messages=turns, **greedy).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert "sunny" in second.message.content and "18" in second.message.content
    parts = client.chat.completions.create(messages=turns, stream=True, **greedy)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == second.message.content

    # required and named: the calls forced (here where the model would answer in words)
    hello = [{"role": "user", "content": "Hello! Who are you?"}]
    words = client.chat.completions.create(messages=hello, **{**greedy, "max_tokens": 4}).choices[0].message
    assert not words.tool_calls and not words.content.lstrip().startswith(("<tool_call>", "{"))
    tools = {"tools": [WEATHER, TIME], "max_tokens": 40}
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = client.chat.completions.create(messages=hello, **{**greedy, **tools, "tool_choice": named})
    [call] = forced.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    assert forced.choices[0].finish_reason == "tool_calls" and forced.choices[0].message.content is None
    chunks = client.chat.completions.create(
        messages=QUESTION, stream=True, **{**greedy, **tools, "tool_choice": "required"}
    )
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls][:1] == [
        ("get_weather", {"city": "Paris"})
    ]

    for bad, param in (
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=QUESTION, **{**greedy, **bad})
        assert e.value.body["param"] == param
