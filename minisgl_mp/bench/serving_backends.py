"""Streaming clients for the serving benchmark: our ZMQ endpoint, or any OpenAI-compatible
`/v1/completions` (ours, vLLM, SGLang). Each fills a RequestRecord with the arrival time of
every chunk that carries output, so TTFT and inter-token gaps come from the wire."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RequestRecord:
    prompt_len: int
    expected_output: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks carrying output, in order
    end: float = 0.0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end > 0 and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1): the mean time per token after the first."""
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive output chunks (a chunk may carry several tokens)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


class Backend(Protocol):
    name: str

    async def send(self, prompt_ids: list[int], output_len: int, rec: RequestRecord) -> None: ...
    async def flush_cache(self) -> bool: ...
    async def engine_stats(self) -> dict[str, Any] | None: ...
    async def close(self) -> None: ...


def sampling(output_len: int) -> dict[str, Any]:
    return {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}


class ZmqBackend:
    name = "zmq"

    def __init__(self, endpoint: str, api_key: str | None = None) -> None:
        from minisgl_mp.client import AsyncClient

        self.endpoint, self.api_key = endpoint, api_key
        self.client = AsyncClient(endpoint, api_key=api_key)

    async def send(self, prompt_ids: list[int], output_len: int, rec: RequestRecord) -> None:
        rid = uuid.uuid4().hex
        rec.start = time.perf_counter()
        try:
            async for reply in self.client.stream(input_ids=prompt_ids, sampling_params=sampling(output_len), rid=rid):
                now = time.perf_counter()
                n = len(reply.get("token_ids") or ())
                if n:
                    rec.chunk_times.append(now)
                    rec.output_tokens += n
                if reply.get("finished"):
                    rec.end = now
                    usage = reply.get("usage") or {}
                    rec.output_tokens = int(usage.get("completion_tokens", rec.output_tokens))
        except asyncio.CancelledError:  # timed out: free its KV on the server too
            with contextlib.suppress(Exception):
                await self.client.abort(rid)
            raise

    def _admin(self, command: str) -> dict[str, Any]:
        from minisgl_mp.client import Client

        with Client(self.endpoint, api_key=self.api_key, timeout=30) as c:
            return c.admin(command)

    async def flush_cache(self) -> bool:
        try:
            return bool((await asyncio.to_thread(self._admin, "flush_cache")).get("ok"))
        except Exception:
            return False

    async def engine_stats(self) -> dict[str, Any] | None:
        try:
            return (await asyncio.to_thread(self._admin, "stats")).get("result")
        except Exception:
            return None

    async def close(self) -> None:
        self.client.close()


class OpenAIBackend:
    """Streaming POST {base_url}/completions. Prompts go as token ids, or as text (decoded
    with `tokenizer`) for servers that take only text. The output token count is the
    server's usage when it sends one (stream_options.include_usage), else the number of
    chunks, else `tokenizer`'s count of the streamed text."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None, tokenizer: Any | None = None,
                 prompt_format: str = "ids", api_key: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        if prompt_format == "text" and tokenizer is None:
            raise ValueError("--prompt-format text needs a tokenizer (--tokenizer)")
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.model, self.tokenizer, self.prompt_format = model, tokenizer, prompt_format
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False)

    async def send(self, prompt_ids: list[int], output_len: int, rec: RequestRecord) -> None:
        prompt: Any = prompt_ids if self.prompt_format == "ids" else self.tokenizer.decode(prompt_ids)
        body: dict[str, Any] = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True},
                                **sampling(output_len)}
        if self.model:
            body["model"] = self.model
        text, usage = [], None
        rec.start = time.perf_counter()
        async with self.http.stream("POST", f"{self.base_url}/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error']}"
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        rec.chunk_times.append(now)
                        text.append(choice["text"])
                    if choice.get("finish_reason"):
                        rec.end = now
        if rec.end == 0 and rec.chunk_times:
            rec.end = rec.chunk_times[-1]
        if usage and usage.get("completion_tokens") is not None:
            rec.output_tokens = int(usage["completion_tokens"])
            rec.prompt_len = int(usage.get("prompt_tokens") or rec.prompt_len)
        elif self.tokenizer is not None:
            rec.output_tokens = len(self.tokenizer.encode("".join(text), add_special_tokens=False))
        else:
            rec.output_tokens = len(rec.chunk_times)

    async def flush_cache(self) -> bool:
        """SGLang's and ours: POST /flush_cache; vLLM's: POST /reset_prefix_cache."""
        for path in ("/flush_cache", "/reset_prefix_cache"):
            try:
                if (await self.http.post(self.root + path)).status_code == 200:
                    return True
            except Exception:
                continue
        return False

    async def engine_stats(self) -> dict[str, Any] | None:
        try:
            resp = await self.http.get(self.root + "/engine_stats")
            return resp.json() if resp.status_code == 200 else None
        except Exception:
            return None

    async def close(self) -> None:
        await self.http.aclose()
