"""The server's configuration: the engine's, plus endpoints, limits and where the internal
sockets live. Built once by the launcher, after everything it depends on is known; each
process receives it whole and reads its own part."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minisgl_mp.engine_config import EngineConfig
from minisgl_mp.server.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ServerArgs:
    """Server options of the command line (the engine's come from EngineConfig)."""

    host: str = field(default="127.0.0.1", metadata=_help("address for HTTP and the ZMQ client endpoint"))
    port: int = field(default=30000, metadata=_help("HTTP port (0: any free port)"))
    zmq_port: int = field(default=30001, metadata=_help("ZMQ client endpoint port (0: any free port)"))
    enable_http: bool = field(default=True, metadata=_help("serve the HTTP API"))
    api_key: str | None = field(default=None, metadata=_help("required as 'Authorization: Bearer <key>' (HTTP) or \"api_key\" (ZMQ)"))
    served_model_name: str | None = field(default=None, metadata=_help("model id in the API (default: --model)"))
    max_payload_bytes: int = field(default=8 << 20, metadata=_help("largest request body or ZMQ message accepted"))
    max_queued_requests: int = field(default=4096, metadata=_help("requests in flight before new ones get 503"))
    max_n: int = field(default=16, metadata=_help("largest n (choices per request)"))
    health_timeout: float = field(default=20.0, metadata=_help("seconds /health waits for the scheduler's answer and /health_generate for its one-token generation"))
    watchdog_timeout: float = field(default=300.0, metadata=_help("a scheduler step longer than this many seconds dumps every thread's stack and stops the server (0: off)"))
    shutdown_timeout: float = field(default=30.0, metadata=_help("on SIGTERM: seconds running requests may take to finish before the rest end with finish_reason 'abort' (Ctrl+C ends them at once; a second signal stops without waiting)"))
    dp_size: int = field(default=1, metadata=_help("data parallelism: scheduler replicas, each with the whole model, its own KV pool (--num-pages / --kv-cache-gb each) and prefix cache, behind one tokenizer process; a request goes to the replica with the longest cached prefix, ties to the shortest queue"))
    startup_timeout: float = field(default=900.0, metadata=_help("seconds to wait for every process to be ready"))
    log_level: str = field(default="info", metadata=_help("debug, info, warning, error"))
    # Several machines (tensor parallelism across nodes; the ranks split evenly over them)
    nnodes: int = field(default=1, metadata=_help("machines the --tp-size ranks run on; node 0 also runs the tokenizer, detokenizer and HTTP"))
    node_rank: int = field(default=0, metadata=_help("this machine's index in [0, --nnodes)"))
    dist_init_addr: str | None = field(default=None, metadata=_help("host:port where the ranks meet (rank 0 listens there); required with --nnodes > 1 (default: a free port on 127.0.0.1)"))
    tool_call_parser: str | None = field(default=None, metadata=_help(f"parse the model's tool calls into OpenAI tool_calls: {', '.join(TOOL_CALL_PARSERS)} (Qwen's <tool_call> blocks)"))
    reasoning_parser: str | None = field(default=None, metadata=_help(f"split the model's thinking into reasoning_content: {', '.join(REASONING_PARSERS)} (<think>...</think>)"))

    def __post_init__(self) -> None:
        for name in ("port", "zmq_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.max_payload_bytes < 1024:
            raise ValueError("max_payload_bytes must be at least 1024")
        if self.max_queued_requests < 1 or self.max_n < 1 or self.dp_size < 1:
            raise ValueError("max_queued_requests, max_n and dp_size must be >= 1")
        for name in ("health_timeout", "watchdog_timeout", "shutdown_timeout", "startup_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address, the same on every node)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")


@dataclass(frozen=True)
class ModelInfo:
    """What the launcher learned about the model before starting any process."""

    name: str  # served model id
    config_path: str
    tokenizer_dir: str | None
    context_len: int
    vocab_size: int


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    server: ServerArgs
    model: ModelInfo
    ipc_dir: str  # private (mode 0700) directory of the internal ipc sockets
    dp_rank: int = 0  # the scheduler replica this copy is for (each scheduler process gets its own)

    def __post_init__(self) -> None:
        if not 0 <= self.dp_rank < self.server.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is outside [0, {self.server.dp_size})")
        if self.server.dp_size > 1 and (self.engine.tp_size > 1 or self.server.nnodes > 1):
            # Each replica would need its own rank group and meeting address; until then, several
            # tensor-parallel servers behind sglang-router do the same (README, Scaling out).
            raise ValueError("--dp-size > 1 cannot be combined with --tp-size > 1 or --nnodes > 1 yet: "
                             "run one server per replica behind sglang-router instead")
        if self.engine.tp_size % self.server.nnodes:
            raise ValueError(f"--tp-size {self.engine.tp_size} must be a multiple of --nnodes {self.server.nnodes}")
        if self.engine.tp_size > 1 and not self.server.dist_init_addr:
            raise ValueError("tensor parallelism needs dist_init_addr (the launcher picks one on one machine)")

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks whose scheduler processes run on this node."""
        per_node = self.engine.tp_size // self.server.nnodes
        return range(self.server.node_rank * per_node, (self.server.node_rank + 1) * per_node)

    @property
    def dist_init_addr(self) -> str:
        return self.server.dist_init_addr or ""

    def ipc(self, name: str) -> str:
        return f"ipc://{Path(self.ipc_dir) / name}.sock"

    @property
    def scheduler_addr(self) -> str:
        """This replica's inbox."""
        return self.scheduler_addrs[self.dp_rank]

    @property
    def scheduler_addrs(self) -> list[str]:
        return [self.ipc(f"scheduler-{rank}") for rank in range(self.server.dp_size)]

    @property
    def scheduler_name(self) -> str:
        return "scheduler" if self.server.dp_size == 1 else f"scheduler_dp{self.dp_rank}"

    @property
    def detokenizer_addr(self) -> str:
        return self.ipc("detokenizer")

    @property
    def tokenizer_addr(self) -> str:
        return self.ipc("tokenizer")

    @property
    def zmq_endpoint(self) -> str:
        host = self.server.host
        return f"tcp://[{host}]:{self.server.zmq_port}" if ":" in host else f"tcp://{host}:{self.server.zmq_port}"

    @property
    def http_url(self) -> str:
        host = self.server.host
        return f"http://[{host}]:{self.server.port}" if ":" in host else f"http://{host}:{self.server.port}"
