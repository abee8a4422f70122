"""Tensor parallelism on the CPU (gloo), through the real server: `--tp-size 2` gives
transformers' greedy choices (teacher-forced, within 1e-3, the same check the one-process
engine passes), on the default model and on one whose single KV head is replicated on both
ranks; the radix cache, chunked prefill, retraction and abort behave as with one rank; a rank
that dies takes the server down naming it; SIGTERM stops every rank; two launchers on one
machine form one server over two "nodes" (on a mixture-of-experts checkpoint).

Each server costs a start-up (two ranks load the model), so each test asks one server many
questions. One torch thread per rank: the machine has 2 cores.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from hf_reference import MakeCheckpoint, check_teacher_forced, load_hf_model, torch_threads
from minisgl_mp.client import Client
from server_utils import launch_server, start_failure, wait_idle_and_whole
from test_reliability import run_clients

TP2 = ("--tp-size", "2", "--num-threads", "1")
GREEDY = {"temperature": 0, "ignore_eos": True}


def _prompts(n: int, seed: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 7900) for _ in range(length)] for _ in range(n)]


def _check_all_teacher_forced(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    with torch_threads():
        hf = load_hf_model(model_dir)
        for prompt, output in zip(prompts, outputs):
            check_teacher_forced(hf, prompt, output)


def _sigterm_stops_everything(srv: Any) -> None:
    """SIGTERM to the launcher: it exits 0 and every rank exits by itself (nothing killed)."""
    procs = srv.children()
    assert len(procs) >= 4  # two ranks, the tokenizer and the detokenizer
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"still running after the launcher exited: {alive}"
    log = "\n".join(srv.read_log(1.0))
    assert "did not stop" not in log, log[-2000:]


def test_tp2_gives_the_same_greedy_tokens_and_sigterm_stops_every_rank(tiny_model_dir: Path) -> None:
    prompts = _prompts(3, seed=1, length=12)
    srv = launch_server(tiny_model_dir, *TP2, "--num-pages", "2048", http=False)
    try:
        assert set(srv.child_pids()) >= {"scheduler", "rank1", "tokenizer", "detokenizer"}
        with Client(srv.zmq, timeout=120) as c:
            outs = [c.generate(input_ids=p, sampling_params={"max_tokens": 8, **GREEDY}) for p in prompts]
            again = c.generate(input_ids=prompts[0], sampling_params={"max_tokens": 8, **GREEDY})
            wait_idle_and_whole(c)
        # The repeated prompt comes from the radix cache (on both ranks' pools) with the same output.
        assert again["usage"]["cached_tokens"] > 0
        assert again["token_ids"] == outs[0]["token_ids"]
        _check_all_teacher_forced(tiny_model_dir, prompts, [o["token_ids"] for o in outs])
        _sigterm_stops_everything(srv)
    finally:
        srv.stop()


def test_tp2_with_ngram_speculation_keeps_the_greedy_tokens(tiny_model_dir: Path) -> None:
    # Prompts that repeat themselves, so the n-gram drafts have something to propose.
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 7900) for _ in range(6)] * 4 for _ in range(3)]
    srv = launch_server(tiny_model_dir, *TP2, "--num-pages", "2048", "--speculative-algorithm", "NGRAM", http=False)
    try:
        with Client(srv.zmq, timeout=120) as c:
            outs = [c.generate(input_ids=p, sampling_params={"max_tokens": 16, **GREEDY}) for p in prompts]
            wait_idle_and_whole(c)
        assert sum(o["usage"].get("spec_verify_ct", 0) for o in outs) > 0, [o["usage"] for o in outs]
        _check_all_teacher_forced(tiny_model_dir, prompts, [o["token_ids"] for o in outs])
    finally:
        srv.stop()


def test_tp2_with_a_replicated_kv_head_chunks_retracts_aborts_and_dies_whole(make_checkpoint: MakeCheckpoint) -> None:
    # One KV head for two ranks: each rank holds a copy of it beside its own two query heads.
    ckpt = make_checkpoint({"num_key_value_heads": 1})
    # 16-token prefill chunks cut every 24-token prompt; 300 KV slots cannot hold 12 requests
    # of 24 + 64 tokens, so some are retracted and resumed.
    srv = launch_server(ckpt, *TP2, "--num-pages", "300", "--max-prefill-tokens", "16", http=False)
    try:
        prompts = _prompts(12, seed=2, length=24)
        got = asyncio.run(run_clients(srv.zmq, [(p, 64) for p in prompts], clients=12, stream=True))
        with Client(srv.zmq, timeout=120) as c:
            stats = wait_idle_and_whole(c)
            assert stats["retractions"] > 0, stats
            rid, chunks = "abort-me", []
            for reply in c.stream(input_ids=prompts[0], sampling_params={"max_tokens": 2000, **GREEDY}, rid=rid):
                chunks.append(reply)
                if len(chunks) == 3:
                    c.abort(rid)
            assert (chunks[-1]["finished"], chunks[-1]["finish_reason"]) == (True, "abort")
            wait_idle_and_whole(c)
        _check_all_teacher_forced(ckpt, prompts, got)

        # A rank that dies takes the whole server down, naming it.
        rank1 = psutil.Process(srv.child_pids()["rank1"])
        procs = srv.children()
        rank1.kill()
        assert srv.proc.wait(60) != 0
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, alive
        log = "\n".join(srv.read_log(1.0))
        assert "scheduler-rank1 process died (killed by signal SIGKILL)" in log, log[-2000:]
    finally:
        srv.stop()


def test_two_nodes_serve_one_model_and_node1_leaves_with_node0(make_checkpoint: MakeCheckpoint) -> None:
    ckpt = make_checkpoint(arch="qwen3_moe")  # experts split by their intermediate columns
    port = _free_port()
    common = ("--model", str(ckpt), *TP2, "--num-pages", "1024", "--nnodes", "2",
              "--dist-init-addr", f"127.0.0.1:{port}")
    node1 = subprocess.Popen([sys.executable, "-m", "minisgl_mp.launch", *common, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    srv = None
    try:
        srv = launch_server(ckpt, *common[2:], "--node-rank", "0", http=False)
        assert set(srv.child_pids()) == {"scheduler", "tokenizer", "detokenizer"}  # rank 1 is on node 1
        prompts = _prompts(2, seed=3, length=10)
        with Client(srv.zmq, timeout=120) as c:
            outs = [c.generate(input_ids=p, sampling_params={"max_tokens": 6, **GREEDY})["token_ids"] for p in prompts]
        _check_all_teacher_forced(ckpt, prompts, outs)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        assert node1.wait(60) == 0  # told by rank 0 to stop
        out = node1.stdout.read()
        assert "minisgl_mp node 1 ready: tensor-parallel ranks 1-1 of 2" in out, out[-2000:]
    finally:
        if srv is not None:
            srv.stop()
        if node1.poll() is None:
            node1.kill()
        node1.wait(10)


def test_a_split_that_cannot_work_is_refused_before_start(make_checkpoint: MakeCheckpoint) -> None:
    ckpt = make_checkpoint({"num_attention_heads": 6, "num_key_value_heads": 3})
    code, lines = start_failure(ckpt, "--tp-size", "2")
    assert code == 1
    assert any("--tp-size 2 must divide num_key_value_heads (3)" in line for line in lines), lines[-5:]
    code, lines = start_failure(ckpt, "--tp-size", "2", "--nnodes", "2")
    assert code != 0
    assert any("--dist-init-addr" in line for line in lines), lines[-5:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
