"""The HTTP app in-process, on a real TokenizerManager whose scheduler is a fake: the states a
real server shows only for an instant (stopping) or that need a broken engine (no token in
time, an error in one of several choices)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from minisgl_mp.engine.tokenizer import load_tokenizer
from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.message.messages import AbortReq, AdminReply, AdminReq, BatchTextOut, GenerateReq, ReqError, TextOut
from minisgl_mp.server.http import build_app
from minisgl_mp.server.metrics import Metrics
from minisgl_mp.server_config import ModelInfo, ServerArgs, ServerConfig
from minisgl_mp.tokenizer.manager import TokenizerManager

SILENT, FAIL = 5, 7  # first prompt token ids the fake engine never answers / answers with an error


class FakeEngine:
    """Scheduler plus detokenizer: a prompt starting with SILENT gets no answer, FAIL gets an
    error, any other gets max_tokens outputs of the token "x"."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()
        self.answering = True  # False: like a scheduler still loading its model

    async def put(self, msg: Any) -> None:
        self.sent.append(msg)
        if self.answering and isinstance(msg, AdminReq) and msg.command == "ping":
            self.outbox.put_nowait(AdminReply(msg.rid, True, {"running": 0, "waiting": 0}))
            return
        if not self.answering or not isinstance(msg, GenerateReq) or msg.input_ids[0] == SILENT:
            return
        if msg.input_ids[0] == FAIL:
            self.outbox.put_nowait(ReqError(msg.rid, "the fake engine failed", "internal"))
            return
        n = msg.sampling_params["max_tokens"]
        for i in range(1, n + 1):
            self.outbox.put_nowait(BatchTextOut([TextOut(
                msg.rid, "x", [87], i == n, "length" if i == n else None, None, len(msg.input_ids), i, 0, [])]))

    async def get(self) -> Any:
        return await self.outbox.get()

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind)]


Scenario = Callable[[httpx.AsyncClient, TokenizerManager, FakeEngine], Awaitable[None]]


def run_app(tokenizer_dir: Path, scenario: Scenario, **server: Any) -> None:
    async def main() -> None:
        config = ServerConfig(
            engine=EngineConfig(model="fake"), server=ServerArgs(**server),
            model=ModelInfo(name="fake-model", config_path="", tokenizer_dir=str(tokenizer_dir),
                            context_len=64, vocab_size=8192),
            ipc_dir="/nonexistent")
        engine = FakeEngine()
        manager = TokenizerManager(config, load_tokenizer(tokenizer_dir), [engine], engine, Metrics("fake-model"))
        dispatch = asyncio.create_task(manager.run_dispatch())
        transport = httpx.ASGITransport(app=build_app(config, manager))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                await scenario(client, manager, engine)
        finally:
            dispatch.cancel()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_fake_engine_serves_a_completion(tokenizer_dir: Path) -> None:
    async def scenario(client: httpx.AsyncClient, manager: TokenizerManager, engine: FakeEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "n": 2, "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["text"] for c in body["choices"]] == ["xxx"] * 4
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 12
        assert manager.states == {}

    run_app(tokenizer_dir, scenario)


@pytest.mark.timeout(60)
def test_stopping_server_answers_503(tokenizer_dir: Path) -> None:
    async def scenario(client: httpx.AsyncClient, manager: TokenizerManager, engine: FakeEngine) -> None:
        manager.stopping = True
        for method, path, body in [("GET", "/health", None), ("GET", "/health_generate", None),
                                   ("POST", "/v1/completions", {"prompt": "hi"}),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                   ("POST", "/generate", {"text": "hi"})]:
            r = await client.request(method, path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert "shutting down" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) > 0  # a router retries elsewhere, later
        assert engine.of(GenerateReq) == []

    run_app(tokenizer_dir, scenario)


@pytest.mark.timeout(60)
def test_health_generate_is_503_until_a_token_comes(tokenizer_dir: Path) -> None:
    async def scenario(client: httpx.AsyncClient, manager: TokenizerManager, engine: FakeEngine) -> None:
        engine.answering = False
        r = await client.get("/health_generate")
        assert r.status_code == 503 and "--health-timeout" in r.json()["error"]["message"]
        await asyncio.sleep(0.05)
        assert [m.rid for m in engine.of(AbortReq)] == [m.rid for m in engine.of(GenerateReq)]  # probe aborted
        engine.answering = True
        assert (await client.get("/health_generate")).status_code == 200
        # Probes are not requests: the metrics saw none of them.
        metrics = manager.metrics.render().decode()
        assert 'sglang:num_requests_total{model_name="fake-model"} 0.0' in metrics, metrics

    run_app(tokenizer_dir, scenario, health_timeout=0.3)


@pytest.mark.timeout(60)
def test_health_is_the_schedulers_liveness(tokenizer_dir: Path) -> None:
    """/health asks the scheduler to answer between two steps: no generation, no request."""
    async def scenario(client: httpx.AsyncClient, manager: TokenizerManager, engine: FakeEngine) -> None:
        engine.answering = False  # a scheduler stuck in a step, or gone
        r = await client.get("/health")
        assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"]
        engine.answering = True
        assert (await client.get("/health")).status_code == 200
        assert engine.of(GenerateReq) == []

    run_app(tokenizer_dir, scenario, health_timeout=0.3)


@pytest.mark.timeout(60)
def test_a_failing_choice_aborts_the_others(tokenizer_dir: Path) -> None:
    async def scenario(client: httpx.AsyncClient, manager: TokenizerManager, engine: FakeEngine) -> None:
        body = {"prompt": [[SILENT, 1], [FAIL, 1]], "max_tokens": 4}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["message"] == "the fake engine failed"
        await asyncio.sleep(0.05)
        silent_rid = engine.of(GenerateReq)[0].rid
        assert [m.rid for m in engine.of(AbortReq)] == [silent_rid] and manager.states == {}
        # In a stream the error arrives as an SSE event, then [DONE].
        r = await client.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200
        lines = [line for line in r.text.split("\n") if line]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["message"] == "the fake engine failed"
        await asyncio.sleep(0.05)
        assert len(engine.of(AbortReq)) == 2 and manager.states == {}

    run_app(tokenizer_dir, scenario, health_timeout=0.3)


# Qwen3's switch, as its chat template has it (the generated model's template has none).
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


@pytest.mark.timeout(60)
def test_chat_template_kwargs_reach_the_template(tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": THINKING_TEMPLATE}))
    messages = [{"role": "user", "content": "Hi"}]
    hf = AutoTokenizer.from_pretrained(tmp_path)
    want = hf.encode(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                            enable_thinking=False), add_special_tokens=False)
    plain = hf.encode(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)

    async def scenario(client: httpx.AsyncClient, manager: TokenizerManager, engine: FakeEngine) -> None:
        for kwargs, expected in [({"enable_thinking": False}, want), (None, plain)]:
            r = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                                "chat_template_kwargs": kwargs})
            assert r.status_code == 200, r.text
            assert engine.of(GenerateReq)[-1].input_ids == list(expected)
        r = await client.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.json()["tokens"] == list(want)
        r = await client.post("/v1/chat/completions", json={"messages": messages, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and "may not set tokenize" in r.json()["error"]["message"]

    assert want != plain
    run_app(tmp_path, scenario)
