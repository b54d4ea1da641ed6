"""The CLI chat in a pseudo-terminal, as a person uses it (CPU engine, the real SmolLM2 fp16).

The chat runs with the pty as its controlling terminal, so Ctrl-C and Ctrl-D go through the
terminal's line discipline as typed keys do: Ctrl-C (SIGINT) stops the reply being written and
returns to `user>`; Ctrl-C or Ctrl-D at the prompt leaves. A conversation longer than the
context drops its oldest turns with a notice and goes on.

The waits are measured in the chat process's own CPU time, not on the wall clock: a loaded machine
slows the process without failing a test. A wait fails when the process exits, spends more CPU
time than the step allows, or stops using the CPU (STALL_S) before it writes what is awaited:
then it waits for something that does not come.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cli import REPO, _env

from pycalm.app.generate import fit_context
from pycalm.model.loader import open_model
from pycalm.model.tokenizer import Tokenizer

PROMPT = "user> "
# A wait fails once the process has used no CPU time at all for this many seconds: it is not
# working but waiting for input (a runnable process gets some CPU time each second, however loaded)
STALL_S = 60.0


class Terminal:
    """A process on a pseudo-terminal: type into it, wait for what it writes."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = os.openpty()

        def controlling_terminal() -> None:  # in the child: a session whose terminal is the pty
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # Ctrl-C's default action, as a terminal gives its program, whatever this process
            # inherited (a test run started in the background of a shell ignores SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=_env(),
            cwd=REPO,
            preexec_fn=controlling_terminal,
        )
        os.close(slave)
        self.out = ""  # everything written so far, "\r\n" as "\n"

    def read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # the process closed the terminal
                data = b""
            self.out += data.decode("utf-8", "replace").replace("\r\n", "\n")

    def cpu_seconds(self) -> float:
        """The CPU time the process has used so far, all its threads (Linux: /proc/PID/stat)."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def wait(self, done: Callable[[], bool], what: object, cpu_s: float) -> None:
        """Read the output until done() holds, while the process works towards it: fails once it
        has exited, spent cpu_s CPU seconds since the call, or used no CPU for STALL_S seconds."""
        start = last = None  # CPU seconds at the first look and at the last increase
        idle_since = time.monotonic()
        while not done():
            if self.proc.poll() is not None:  # it ended: what it wrote last is all that will come
                for _ in range(20):
                    self.read(0.05)
                assert done(), ("the process exited", what, self.out)
                return
            used = self.cpu_seconds()  # an ended process stays readable until poll() reaps it
            if last is None:
                start = last = used
            if used > last:
                last, idle_since = used, time.monotonic()
            assert used - start < cpu_s, (f"{cpu_s} CPU seconds spent", what, self.out)
            assert time.monotonic() - idle_since < STALL_S, ("the process stopped working", what, self.out)
            self.read(0.1)

    def expect(self, pattern: str, start: int = 0, cpu_s: float = 120) -> re.Match:
        """The first match of `pattern` in the output after `start`, waiting for it (`wait`)."""
        regex = re.compile(pattern)
        self.wait(lambda: regex.search(self.out, start) is not None, pattern, cpu_s)
        return regex.search(self.out, start)

    def type(self, text: str) -> int:
        """Type text; returns where the output stood (what comes after is the answer to it)."""
        at = len(self.out)
        os.write(self.master, text.encode())
        return at

    def wait_exit(self, cpu_s: float = 60) -> int:
        """The exit code, once the process has ended (`wait`) and what it wrote last is read."""
        self.wait(lambda: self.proc.poll() is not None, "exit", cpu_s)
        for _ in range(20):  # what was written just before the end
            self.read(0.05)
        return self.proc.wait(timeout=5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def chat(smollm2_fp16):
    terms = []

    def start(*flags: str) -> Terminal:
        cmd = [
            sys.executable,
            "-m",
            "pycalm.generate",
            str(smollm2_fp16),
            "-t",
            "0",
            "--device",
            "cpu",
            *flags,
        ]
        terms.append(Terminal(cmd))
        return terms[-1]

    yield start
    for t in terms:
        t.close()


def test_ctrl_c_stops_the_reply_and_a_second_leaves(chat):
    term = chat("-y", "", "-n", "2000", "-c", "2048")
    term.expect(PROMPT)
    at = term.type("Write a very long story about a dragon who loves tea.\n")
    echo = term.expect(r"tea\.\n", at).end()
    term.expect(r"\w+ \w+ \w+ \w+ \w+", echo)  # a few words of the reply
    at = term.type("\x03")
    term.expect(PROMPT, at, cpu_s=20)  # back at the prompt: the reply stopped
    assert term.proc.poll() is None  # the chat goes on
    at = term.type("What is the capital of France?\n")
    term.expect("Paris", at)
    term.expect(PROMPT, at)
    at = term.type("\x03")  # Ctrl-C at the prompt leaves, with the timing line
    assert term.wait_exit() == 0, term.out
    assert re.search(r"pycalm \(cpu\): .*prompt \d+ tokens.*tok/s.*decode", term.out[at:]), term.out


def test_ctrl_d_leaves(chat):
    term = chat("-y", "", "-n", "8")
    term.expect(PROMPT)
    at = term.type("\x04")
    assert term.wait_exit() == 0, term.out
    assert "Traceback" not in term.out and "pycalm (cpu)" in term.out[at:]


def test_context_shift_drops_the_oldest_turns(chat):
    term = chat("-y", "You are a helpful assistant.", "-n", "12", "-c", "128")
    term.expect(PROMPT)
    questions = [
        "What is 2 + 2?",
        "Name a color.",
        "Name a fruit.",
        "Name an animal.",
        "Name a city.",
        "Say hi.",
    ]
    for q in questions:
        at = term.type(q + "\n")
        term.expect(PROMPT, at + len(q))  # answered, and back at the prompt
    notices = re.findall(
        r"pycalm: the conversation outgrew the context of 128 tokens; dropped the oldest \d+ turns?", term.out
    )
    assert notices, term.out
    at = term.type("\x04")
    assert term.wait_exit() == 0, term.out
    assert "Traceback" not in term.out


def test_fit_context_keeps_the_system_prompt(smollm2_fp16, capsys):
    model = open_model(smollm2_fp16)
    cfg = model.config
    tok = Tokenizer.from_blob(
        model.tokenizer_kind, model.tokenizer_blob, cfg.bos_id, cfg.eos_ids, model.chat_template
    )
    system = {"role": "system", "content": "Be brief."}
    turns = [
        [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
        for i in range(6)
    ]
    messages = [system, *(m for t in turns for m in t), {"role": "user", "content": "Last?"}]
    full = len(tok.encode(tok.apply_chat_template(messages), add_bos=False))
    seq_len, steps = full - 10, 16  # room for the reply needs a few turns gone
    ids = fit_context(tok, messages, seq_len, steps)
    assert ids is not None and len(ids) <= seq_len - steps
    assert messages[0] == system and messages[-1]["content"] == "Last?"
    dropped = (13 - len(messages) + 1) // 2
    assert messages[1:-1] == [m for t in turns[dropped:] for m in t] and dropped >= 1
    assert ids == tok.encode(tok.apply_chat_template(messages), add_bos=False)
    assert f"dropped the oldest {dropped} turn" in capsys.readouterr().err
    # a message that cannot fit on its own is not sent, and the conversation stays as it was
    kept = list(messages)
    messages.append({"role": "user", "content": "word " * 400})
    assert fit_context(tok, messages, seq_len, steps) is None and messages == kept
