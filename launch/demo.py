"""`make demo`: start the server on a model, ask it questions (answers streamed through the
ZMQ client, the chat template applied by the server), show a second chat turn reusing the
cached prefix, print the engine's stats, and stop the server.

    python launch/demo.py                                   # SmolLM2-135M-Instruct, the default
    python launch/demo.py --model models/qwen3-tiny         # any --model the server takes
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

from minisgl_mp.client import Client

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a Python function that adds two numbers.",
]


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "minisgl_mp.launch", "--model", model, "--port", "0", "--zmq-port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print("  server| " + line, end="")
        m = re.search(r"zmq (tcp://\S+?)[,\s]", line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"server exited with code {proc.wait()} before it was ready")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--max-tokens", type=int, default=64)
    args, extra = ap.parse_known_args()
    proc, endpoint = start_server(args.model, extra)
    try:
        with Client(endpoint, timeout=120) as client:
            params = {"max_tokens": args.max_tokens, "temperature": 0}
            for question in QUESTIONS:
                print(f"\n>>> {question}")
                t0 = time.perf_counter()
                last = {}
                for chunk in client.stream(messages=[{"role": "user", "content": question}], sampling_params=params):
                    print(chunk["text"], end="", flush=True)
                    last = chunk
                dt = time.perf_counter() - t0
                u = last.get("usage", {})
                print(f"\n    [{u.get('completion_tokens')} tokens in {dt:.2f}s, finish: {last.get('finish_reason')}]")
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is a list in Python?"}]
            for turn in range(2):
                reply = client.generate(messages=messages, sampling_params=params)
                print(f"\n>>> chat turn {turn + 1}: {messages[-1]['content']}\n{reply['text']}")
                print(f"    [prompt {reply['usage']['prompt_tokens']} tokens, "
                      f"{reply['usage']['cached_tokens']} of them from the prefix cache]")
                messages += [{"role": "assistant", "content": reply["text"]},
                             {"role": "user", "content": "And a tuple?"}]
            stats = client.admin("stats")["result"]
            print(f"\nengine: {stats['finished']} requests, {stats['prefill_tokens']} prefill tokens computed, "
                  f"{stats['cached_prompt_tokens']} served from the cache")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        print(f"server stopped (exit code {code})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
