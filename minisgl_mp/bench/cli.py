"""Flags shared by the `python -m minisgl_mp.bench` subcommands: each one's parser, the
workload flags of the offline and serving benchmarks (with per-mode defaults), and list types.

A flag left unset takes the workload's default for the mode (full or --quick), so
`--workload shared-prefix --quick` is a complete, small run and any size can still be set.
"""

from __future__ import annotations

import argparse
from typing import Any

from minisgl_mp.bench.workloads import (
    WORKLOADS, LengthRange, Workload, multi_turn_workload, random_workload, shared_prefix_workload,
)

# The full random and shared-prefix workloads are the issue's: 64 requests, input U(64, 512),
# output U(32, 256); 8 groups x 8 prompts, 1,024-token system prompt, 64-token questions.
DEFAULTS: dict[str, dict[str, Any]] = {
    "random": {"num_prompts": 64, "input_len": "64,512", "output_len": "32,256"},
    "shared-prefix": {"num_groups": 8, "prompts_per_group": 8, "system_len": "1024", "question_len": "64",
                      "output_len": "64"},
    "multi-turn": {"num_prompts": 16, "num_turns": 4, "system_len": "128", "input_len": "32,128",
                   "output_len": "32,64"},
}
QUICK_DEFAULTS: dict[str, dict[str, Any]] = {
    "random": {"num_prompts": 32, "input_len": "32,128", "output_len": "16,64"},
    "shared-prefix": {"num_groups": 4, "prompts_per_group": 4, "system_len": "256", "question_len": "32",
                      "output_len": "32"},
    "multi-turn": {"num_prompts": 4, "num_turns": 3, "system_len": "64", "input_len": "16,64",
                   "output_len": "16,32"},
}


def bench_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand's own parser: its usage line names the command a user types, and its help
    is the module's docstring as written."""
    return argparse.ArgumentParser(prog=f"python -m minisgl_mp.bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_workload_args(parser: argparse.ArgumentParser, workloads: tuple[str, ...] = WORKLOADS) -> None:
    g = parser.add_argument_group("workload (unset sizes take the workload's default for the mode)")
    g.add_argument("--workload", choices=workloads, default="random", help="what requests to send (default: random)")
    g.add_argument("--num-prompts", type=int, help="random: requests; multi-turn: conversations "
                   "(default 64 / quick 32; multi-turn 16 / quick 4)")
    g.add_argument("--input-len", help="random: prompt tokens, N or MIN,MAX uniform (default 64,512 / quick 32,128); "
                   "multi-turn: new user tokens per turn")
    g.add_argument("--output-len", help="output tokens per request, N or MIN,MAX (default: random 32,256 / "
                   "quick 16,64; shared-prefix 64 / quick 32)")
    g.add_argument("--num-groups", type=int, help="shared-prefix: groups (default 8 / quick 4)")
    g.add_argument("--prompts-per-group", type=int, help="shared-prefix: prompts per group (default 8 / quick 4)")
    g.add_argument("--system-len", help="shared-prefix / multi-turn: system prompt tokens (shared-prefix default 1024, multi-turn 128; quick 256 / 64)")
    g.add_argument("--question-len", help="shared-prefix: question tokens after the system prompt (default 64 / quick 32)")
    g.add_argument("--num-turns", type=int, help="multi-turn: turns per conversation (default 4 / quick 3)")


def resolved(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    if value is not None:
        return value
    table = QUICK_DEFAULTS if args.quick else DEFAULTS
    return table[args.workload].get(name)


def workload_from_args(args: argparse.Namespace, token_range: int) -> Workload:
    """Raises ValueError naming a bad size."""
    def r(name: str) -> LengthRange:
        return LengthRange.parse(str(resolved(args, name)))

    seed = args.seed
    if args.workload == "random":
        return random_workload(_positive(args, "num_prompts"), r("input_len"), r("output_len"), token_range, seed)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(_positive(args, "num_groups"), _positive(args, "prompts_per_group"),
                                      r("system_len"), r("question_len"), r("output_len"), token_range, seed)
    system = resolved(args, "system_len")
    return multi_turn_workload(_positive(args, "num_prompts"), _positive(args, "num_turns"),
                               LengthRange.parse(str(system)) if system and str(system) != "0" else None,
                               r("input_len"), r("output_len"), token_range, seed)


def _positive(args: argparse.Namespace, name: str) -> int:
    value = int(resolved(args, name))
    if value < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return value


def int_list(text: str, minimum: int = 1) -> list[int]:
    """'1,8,32' -> [1, 8, 32] (argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < minimum:
        what = "positive integers" if minimum == 1 else f"integers of at least {minimum}"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def count_list(text: str) -> list[int]:
    """'0,32,256' -> [0, 32, 256]: int_list with 0 allowed (argparse type)."""
    return int_list(text, minimum=0)


def token_range_of(tokenizer: Any, vocab_size: int) -> int:
    """Prompt ids are drawn below this: the tokenizer's ordinary tokens (they decode to text
    and back), or the whole vocabulary without a tokenizer."""
    n = getattr(tokenizer, "vocab_size", None) if tokenizer is not None else None
    return min(int(n), vocab_size) if n else vocab_size
