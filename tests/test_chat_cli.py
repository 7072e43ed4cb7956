"""`airframe chat` in a real terminal (tmux): it answers, keeps history, resets and exits cleanly;
and `airframe run` end to end."""

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

CHAT = [sys.executable, "-m", "airframe", "chat", "smollm2-135m", "--backend", "reference",
        "-n", "4", "--temp", "0", "--ctx", "256", "--system", "Be brief."]
SPEED = re.compile(r"prompt (\d+) tokens, prefill [\d.]+ tokens/s, (\d+) generated")


class Terminal:
    """One tmux server of our own (its own socket) running one command in a 200x50 window."""

    def __init__(self, command: list[str]):
        self.socket = f"airframe-test-{os.getpid()}-{time.monotonic_ns()}"
        shell = f"{shlex.join(command)}; echo EXITED $?; sleep 60"
        self.tmux("new-session", "-d", "-s", "chat", "-x", "200", "-y", "50", shell)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True, capture_output=True, text=True).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-500", "-t", "chat")

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)
        self.tmux("send-keys", "-t", "chat", "Enter")

    def wait_for(self, predicate, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if predicate(screen):
                return screen
            time.sleep(0.2)
        raise AssertionError(f"timed out; the terminal shows:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def terminal():
    opened = []

    def open_terminal(command):
        opened.append(Terminal(command))
        return opened[-1]

    yield open_terminal
    for t in opened:
        t.close()


def prompt_counts(screen: str) -> list[int]:
    return [int(m.group(1)) for m in SPEED.finditer(screen)]


def test_chat_answers_keeps_history_resets_and_exits(terminal):
    term = terminal(CHAT)
    term.wait_for(lambda s: s.rstrip().endswith(">"))
    term.type("Hi")
    screen = term.wait_for(lambda s: len(prompt_counts(s)) == 1)
    answer = screen.split("> Hi", 1)[1].split("[", 1)[0].strip()
    assert answer, f"no answer text on the screen:\n{screen}"
    term.type("Hi")
    term.wait_for(lambda s: len(prompt_counts(s)) == 2)
    term.type("/reset")
    term.wait_for(lambda s: "(conversation reset)" in s)
    term.type("Hi")
    screen = term.wait_for(lambda s: len(prompt_counts(s)) == 3)
    first, with_history, after_reset = prompt_counts(screen)
    assert with_history > first  # the second question carried the first exchange
    assert after_reset == first  # /reset forgot it
    term.type("/exit")
    screen = term.wait_for(lambda s: "EXITED" in s, timeout=30)
    assert "EXITED 0" in screen and "Traceback" not in screen


def test_chat_leaves_on_end_of_input(terminal):
    term = terminal(CHAT)
    term.wait_for(lambda s: s.rstrip().endswith(">"))
    term.tmux("send-keys", "-t", "chat", "C-d")
    screen = term.wait_for(lambda s: "EXITED" in s, timeout=30)
    assert "EXITED 0" in screen and "Traceback" not in screen


def test_run_streams_the_answer_and_a_speed_line():
    command = [sys.executable, "-m", "airframe", "run", "smollm2-135m", "The capital of France is",
               "--backend", "reference", "-n", "3", "--temp", "0", "--ctx", "64"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is") and len(done.stdout) > len("The capital of France is\n")
    counts = SPEED.search(done.stderr)
    assert counts and int(counts.group(2)) <= 3


def test_run_reports_a_bad_parameter_without_a_traceback():
    command = [sys.executable, "-m", "airframe", "run", "smollm2-135m", "x", "--backend", "reference",
               "--top-p", "7"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "--top-p = 7.0, expected a number in 0.0..1.0" in done.stderr and "Traceback" not in done.stderr


def test_run_chat_sends_the_prompt_through_the_template(capsys):
    from airframe.cli import main

    args = ["run", "smollm2-135m", "Capital of France?", "--chat", "--backend", "reference",
            "-n", "2", "--temp", "0", "--ctx", "64"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert not out.startswith("Capital of France?")  # a chat answer does not echo the question
    prompt_tokens = int(SPEED.search(err).group(1))
    assert prompt_tokens > 20  # SmolLM2's template adds its default system turn and the role headers


def test_run_json_schema_answers_valid_json(capsys, tmp_path):
    from airframe.cli import main

    schema = {"type": "object", "properties": {"answer": {"enum": ["Paris", "Lyon"]}}, "required": ["answer"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    args = ["run", "smollm2-135m", "Capital of France?", "--chat", "--backend", "reference",
            "-n", "30", "--temp", "0", "--ctx", "128", "--json-schema", str(path)]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["answer"] in ("Paris", "Lyon")
    assert "[stop]" in err


def test_run_grammar_limits_the_answer(capsys, tmp_path):
    from airframe.cli import main

    path = tmp_path / "yes_no.gbnf"
    path.write_text('root ::= "yes" | "no"\n')
    args = ["run", "smollm2-135m", "Is Paris in France?", "--chat", "--backend", "reference",
            "-n", "8", "--temp", "0", "--ctx", "128", "--grammar", str(path)]
    assert main(args) == 0
    out, _ = capsys.readouterr()
    assert out.strip() in ("yes", "no")


def test_run_reports_a_bad_grammar_file_without_a_traceback(tmp_path):
    path = tmp_path / "bad.gbnf"
    path.write_text('root ::= ("a"')
    command = [sys.executable, "-m", "airframe", "run", "smollm2-135m", "x", "--backend", "reference",
               "--grammar", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"--grammar {path}: grammar cannot be parsed" in done.stderr and "Traceback" not in done.stderr


def test_speed_line_of_a_prefill_and_of_a_backend_that_times_prompt_and_answer_together():
    from airframe.commands.run import speed_line
    from airframe.engine import Finish

    # prefill timed apart (the WebGPU and reference paths): 10 tokens in 0.5 s, then 4 more tokens in 0.2 s
    assert speed_line(Finish("length", 10, 5, 0.5, 0.2)) == (
        "[length] prompt 10 tokens, prefill 20.0 tokens/s, 5 generated, decode 20.0 tokens/s (50.0 ms/token)")
    # the CUDA megakernel runs the prompt in the answer's launches (prefill_seconds 0): 5 + 24 - 1
    # steps in 0.028 s, never "prefill 0.0 tokens/s"
    line = speed_line(Finish("length", 5, 24, 0.0, 0.028))
    assert line == ("[length] prompt 5 tokens, 24 generated, 1000.0 tokens/s over prompt and answer together "
                    "(1.0 ms/token)")
    assert speed_line(Finish("stop", 5, 0, 0.0, 0.0)) == "[stop] prompt 5 tokens, 0 generated"
    # 30 of 40 prompt tokens kept from the prompt cache: the prefill rate is over the 10 that ran
    assert speed_line(Finish("stop", 40, 1, 0.5, 0.0, cached_tokens=30)) == (
        "[stop] prompt 40 tokens, prefill 20.0 tokens/s, 1 generated; 30 prompt tokens from the prompt cache")
