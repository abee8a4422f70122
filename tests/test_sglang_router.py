"""sglang-router (SGLang's load balancer for data parallelism, PyPI `sglang-router`) in front of
two replicas: it learns the model from them, adds SGLang's extra fields to every OpenAI request,
and forwards /generate as is; every answer must come back whole, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_utils import ServerProcess, launch_router, launch_server

pytest.importorskip("sglang_router")
TIMEOUT = 180


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with launch_server(tiny_model_dir, "--num-pages", "2048") as a, launch_server(tiny_model_dir, "--num-pages", "2048") as b:
        yield a, b


@pytest.fixture(scope="module")
def router(replicas: tuple[ServerProcess, ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    with launch_router([r.http for r in replicas], "round_robin", log_path) as url:
        yield url


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.timeout(TIMEOUT)
def test_router_names_our_model(router: str, replicas: tuple[ServerProcess, ServerProcess]) -> None:
    models = httpx.get(router + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [replicas[0].model]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("stream", [False, True])
def test_openai_endpoints_through_the_router(router: str, replicas: tuple[ServerProcess, ServerProcess],
                                             stream: bool) -> None:
    model = replicas[0].model
    with httpx.Client(base_url=router, timeout=60) as c:
        for _ in range(2):  # round robin: one request on each replica
            chat = c.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 4, "ignore_eos": True, "stream": stream})
            cmpl = c.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4,
                                                   "ignore_eos": True, "stream": stream})
            if stream:
                assert [e["choices"][0]["finish_reason"] for e in _events(chat) if e["choices"]][-1] == "length"
                assert sum(bool(e["choices"][0]["text"]) for e in _events(cmpl)) >= 1
            else:
                assert chat.status_code == cmpl.status_code == 200, (chat.text, cmpl.text)
                assert chat.json()["usage"]["completion_tokens"] == cmpl.json()["usage"]["completion_tokens"] == 4


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("stream", [False, True])
def test_native_generate_through_the_router(router: str, stream: bool) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "stream": stream}
    with httpx.Client(base_url=router, timeout=60) as c:
        r = c.post("/generate", json=body)
        out = _events(r)[-1] if stream else r.json()
    assert r.status_code == 200, r.text
    assert len(out["output_ids"]) == 6 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
