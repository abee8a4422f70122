"""launch/client.py as a user runs it: prompts from arguments, a file or stdin, streaming or
not, a chat that reuses its cached prefix, and clear failures (exit 1) when the server is not
there or refuses a request."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from minisgl_mp.client import Client
from server_utils import ServerProcess, launch_server

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "client.py"
GREEDY = ("--max-tokens", "8", "--temperature", "0", "--ignore-eos")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    srv = launch_server(tiny_model_dir, "--load-format", "dummy", "--no-cpu-prepack", "--num-pages", "8192",
                        "--num-threads", "1", http=False)
    try:
        yield srv
    finally:
        srv.stop()


def run(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def greedy_text(server: ServerProcess, prompt: str) -> str:
    with Client(server.zmq, timeout=60) as c:
        return c.generate(prompt, sampling_params={"max_tokens": 8, "temperature": 0, "ignore_eos": True})["text"]


def test_a_prompt_prints_its_completion_and_a_summary(server: ServerProcess) -> None:
    out = run("--endpoint", server.zmq, "The sky is", *GREEDY)
    assert out.returncode == 0, out.stderr
    assert out.stdout == greedy_text(server, "The sky is") + "\n"
    assert "requests: 1\n" in out.stderr
    assert re.search(r"^tokens: prompt \d+, completion 8, cached \d+$", out.stderr, re.M)
    assert "total time: " in out.stderr and " tokens/s" in out.stderr


def test_stream_prints_the_same_text_and_the_time_to_first_token(server: ServerProcess) -> None:
    out = run("--endpoint", server.zmq, "--stream", "The sky is", *GREEDY)
    assert out.returncode == 0, out.stderr
    assert out.stdout == greedy_text(server, "The sky is") + "\n"
    assert "time to first token: mean " in out.stderr and " p50 " in out.stderr


def test_prompts_from_a_file_run_concurrently(server: ServerProcess, tmp_path: Path) -> None:
    prompts = ["First prompt", "Second prompt", "", "Third prompt"]  # blank lines are skipped
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    out = run("--endpoint", server.zmq, "--file", str(tmp_path / "prompts.txt"), "--concurrency", "3", "--stream",
              *GREEDY)
    assert out.returncode == 0, out.stderr
    want = {f"[{i}] {greedy_text(server, p)}" for i, p in enumerate(p for p in prompts if p)}
    assert set(out.stdout.splitlines()) == want
    assert "requests: 3\n" in out.stderr and "time to first token" in out.stderr


def test_prompts_from_stdin_and_raw_json_replies(server: ServerProcess) -> None:
    out = run("--endpoint", server.zmq, "--json", "--stream", *GREEDY, stdin="One\nTwo\n")
    assert out.returncode == 0, out.stderr
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    finals = [r for r in replies if r["finished"]]
    assert len(finals) == 2 and all(r["usage"]["completion_tokens"] == 8 for r in finals)
    assert len(replies) == 16  # one per token when streaming


def test_chat_keeps_the_conversation_and_reuses_its_cached_prefix(server: ServerProcess) -> None:
    out = run("--endpoint", server.zmq, "--chat", "--stream", *GREEDY, stdin="Hello there\n\nTell me more\n")
    assert out.returncode == 0, out.stderr
    turns = [line for line in out.stderr.splitlines() if line.startswith("[turn ")]
    assert len(turns) == 2, out.stderr
    first_prompt = int(turns[0].split("prompt ")[1].split(" ")[0])
    second_prompt = int(turns[1].split("prompt ")[1].split(" ")[0])
    second_cached = int(turns[1].split("tokens, ")[1].split(" cached")[0])
    assert second_prompt > first_prompt + 8  # the whole conversation is sent again...
    assert second_cached >= first_prompt  # ...and its start comes from the prefix cache
    assert "requests: 2\n" in out.stderr


def test_an_unreachable_server_fails_fast_with_a_clear_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    out = run("--endpoint", endpoint, "--connect-timeout", "1", "Hello", timeout=30)
    assert out.returncode == 1
    assert f"error: no answer from {endpoint} within 1 s: is the server running there?" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_a_request_the_server_refuses_fails_with_its_message(server: ServerProcess) -> None:
    out = run("--endpoint", server.zmq, "Hello", "--temperature", "-1")
    assert out.returncode == 1
    assert "server error: invalid_request: temperature must be a number >= 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_flags_exit_2_with_usage() -> None:
    out = run("--concurrency", "0", "Hello", timeout=30)
    assert out.returncode == 2
    assert "--concurrency must be >= 1" in out.stderr
