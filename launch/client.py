"""Send prompts to a running minisgl_mp server over its ZMQ endpoint and print the replies.

    python launch/client.py "The capital of France is" --max-tokens 32 --temperature 0
    python launch/client.py --file prompts.txt --concurrency 8     # one prompt per line
    echo "Once upon a time" | python launch/client.py --stream     # text as it arrives
    python launch/client.py --chat --stream                        # a conversation, one line a turn

Generated text goes to stdout; the summary (requests, tokens, time to first token, throughput)
and errors go to stderr. Sampling flags left out take the server's defaults. Exit status: 0 when
every request succeeded, 1 on a server error or when the server does not answer, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from minisgl_mp.client import DEFAULT_ENDPOINT, AsyncClient, Client, ServerError

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


class NoReply(Exception):
    """The server did not answer in time."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts (default: --file, else one per line of stdin)")
    p.add_argument("--file", help="a file with one prompt per line")
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help=f"the server's ZMQ endpoint ({DEFAULT_ENDPOINT})")
    p.add_argument("--api-key", help="the server's --api-key")
    p.add_argument("--stream", action="store_true", help="print text as it arrives")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default: 1)")
    p.add_argument("--chat", action="store_true", help="a conversation: each line of stdin is your turn")
    p.add_argument("--json", action="store_true", help="print every raw reply as a JSON line")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for the server's first answer")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each later reply")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0: greedy")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep going past end-of-sequence")
    args = p.parse_args(argv)
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.chat and (args.prompts or args.file):
        p.error("--chat reads its turns from stdin; give no prompts or --file")
    return args


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    elif sys.stdin.isatty():
        raise SystemExit("error: no prompts: give them as arguments, with --file, or on stdin")
    else:
        lines = sys.stdin.read().splitlines()
    return [line for line in lines if line.strip()]


@dataclass
class Summary:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def add(self, final: dict[str, Any], ttft: float | None) -> None:
        usage = final.get("usage", {})
        self.requests += 1
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += usage.get("cached_tokens", 0)
        if ttft is not None:
            self.ttfts.append(ttft)

    def report(self) -> str:
        elapsed = time.perf_counter() - self.started
        lines = [f"requests: {self.requests}" + (f" ({self.failed} failed)" if self.failed else ""),
                 f"tokens: prompt {self.prompt_tokens}, completion {self.completion_tokens}, "
                 f"cached {self.cached_tokens}"]
        if self.ttfts:
            lines.append(f"time to first token: mean {statistics.mean(self.ttfts):.3f} s, "
                         f"p50 {statistics.median(self.ttfts):.3f} s")
        lines.append(f"total time: {elapsed:.2f} s, output: {self.completion_tokens / max(elapsed, 1e-9):.1f} tokens/s")
        return "\n".join(lines)


@dataclass
class Tracker:
    """One request's replies: its text so far, its time to first token, its final reply."""

    start: float = field(default_factory=time.perf_counter)
    ttft: float | None = None
    parts: list[str] = field(default_factory=list)
    final: dict[str, Any] | None = None

    def feed(self, reply: dict[str, Any]) -> None:
        if self.ttft is None and reply.get("token_ids"):
            self.ttft = time.perf_counter() - self.start
        self.parts.append(reply.get("text", ""))
        if reply.get("finished"):
            self.final = reply

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def final_reply(self) -> dict[str, Any]:
        if self.final is None:
            raise NoReply("the replies ended without a finished one")
        return self.final


def print_json(reply: dict[str, Any]) -> None:
    print(json.dumps(reply, ensure_ascii=False, default=repr), flush=True)


def check_server(args: argparse.Namespace) -> None:
    """A quick stats request, so that a wrong endpoint fails fast with a clear message."""
    with Client(args.endpoint, api_key=args.api_key, timeout=args.connect_timeout) as client:
        try:
            client.admin("stats")
        except TimeoutError:
            raise NoReply(f"no answer from {args.endpoint} within {args.connect_timeout:g} s: is the server "
                          "running there? (python -m minisgl_mp.launch --model <model>)") from None


async def replies(stream: AsyncGenerator[dict[str, Any], None], timeout: float) -> AsyncIterator[dict[str, Any]]:
    try:
        while True:
            try:
                yield await asyncio.wait_for(stream.__anext__(), timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise NoReply(f"no reply within {timeout:g} s: the server stopped answering") from None
    finally:
        await stream.aclose()


async def run_batch(args: argparse.Namespace, prompts: list[str], params: dict[str, Any]) -> Summary:
    client = AsyncClient(args.endpoint, api_key=args.api_key)
    summary = Summary()
    slots = asyncio.Semaphore(args.concurrency)
    live = args.stream and args.concurrency == 1 and not args.json
    label = (lambda i: f"[{i}] ") if len(prompts) > 1 else (lambda i: "")

    async def one(i: int, prompt: str) -> None:
        async with slots:
            t = Tracker()
            if live:
                print(label(i), end="", flush=True)
            try:
                stream = client.stream(prompt, sampling_params=params, stream=args.stream)
                async for reply in replies(stream, args.timeout):
                    t.feed(reply)
                    if args.json:
                        print_json(reply)
                    elif live:
                        print(reply.get("text", ""), end="", flush=True)
            except ServerError as e:
                summary.failed += 1
                if live:
                    print(flush=True)
                print(f"{label(i)}server error: {e}", file=sys.stderr, flush=True)
                return
            summary.add(t.final_reply(), t.ttft if args.stream else None)
            if live:
                print(flush=True)
            elif not args.json:
                print(f"{label(i)}{t.text}", flush=True)

    tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        client.close()
    return summary


def run_chat(args: argparse.Namespace, params: dict[str, Any]) -> Summary:
    """Each turn sends the whole conversation; its start is the previous turn's prompt plus
    reply, so the server finds it in its prefix cache (the 'cached' count of each turn)."""
    summary = Summary()
    messages: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    with Client(args.endpoint, api_key=args.api_key, timeout=args.timeout) as client:
        while True:
            try:
                line = input("you> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            if not line:  # end of input
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            t = Tracker()
            chunks = (client.stream(messages=messages, sampling_params=params) if args.stream
                      else [client.generate(messages=messages, sampling_params=params)])
            for reply in chunks:
                t.feed(reply)
                if args.json:
                    print_json(reply)
                elif args.stream:
                    print(reply.get("text", ""), end="", flush=True)
            if args.stream and not args.json:
                print(flush=True)
            elif not args.json:
                print(t.text, flush=True)
            final = t.final_reply()
            messages.append({"role": "assistant", "content": t.text})
            summary.add(final, t.ttft if args.stream else None)
            usage = final.get("usage", {})
            print(f"[turn {summary.requests}: prompt {usage.get('prompt_tokens')} tokens, "
                  f"{usage.get('cached_tokens')} cached, {usage.get('completion_tokens')} generated, "
                  f"{time.perf_counter() - t.start:.2f} s]", file=sys.stderr, flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = sampling_params(args)
    try:
        prompts = [] if args.chat else read_prompts(args)
        check_server(args)
        summary = run_chat(args, params) if args.chat else asyncio.run(run_batch(args, prompts, params))
    except (NoReply, TimeoutError) as e:  # TimeoutError: the blocking client's, in a chat
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ServerError as e:
        print(f"server error: {e}", file=sys.stderr)
        return 1
    except zmq.ZMQError as e:
        print(f"error: cannot use endpoint {args.endpoint!r}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # requests in flight are aborted by the server when their replies bounce
    print(summary.report(), file=sys.stderr)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
