"""What the chat output parsers cost the tokenizer process: a Qwen3-style response (thinking,
an answer, a tool call) fed in small deltas through the reasoning and tool-call parsers, as a
stream with --tool-call-parser qwen --reasoning-parser qwen3 runs it, against the same deltas
through no parser (the plain path only copies the text).

    python launch/bench_chat_parsers.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from minisgl_mp.server.chat_output import ChatOutput, ChatOutputSpec

RESPONSE = ("<think>\n" + "The user asks about the weather, so I should call the tool. " * 20 + "\n</think>\n\n"
            "Let me check.\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3], "unit": "C"}}\n</tool_call>')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delta-chars", type=int, default=4, help="characters per delta (about a token)")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    deltas = [RESPONSE[i:i + args.delta_chars] for i in range(0, len(RESPONSE), args.delta_chars)]
    spec = ChatOutputSpec(tool_parser="qwen", tool_names=("get_weather",), reasoning_parser="qwen3", in_reasoning=True)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(args.repeats):
            out = ChatOutput(spec)
            for d in deltas:
                out.feed(d)
            out.finish()
        runs.append((time.perf_counter() - start) / (args.repeats * len(deltas)))
    print(f"{len(deltas)} deltas of {args.delta_chars} chars: median {statistics.median(runs) * 1e6:.1f} us "
          f"per delta (min {min(runs) * 1e6:.1f}) through the qwen3 reasoning and qwen tool-call parsers")


if __name__ == "__main__":
    main()
