"""The tensor-parallel process group: one scheduler process per rank, joined over
torch.distributed (gloo on the CPU, NCCL on CUDA, with a gloo group beside it for the host-side
messages, as SGLang keeps one). Everything crossing ranks is a tensor: messages go as their
msgpack bytes in a uint8 tensor, never pickled.

Every collective is called by every rank in the same order; rank 0 decides (what arrived,
which token was sampled) and the others follow. A collective that fails means a rank is gone,
and the caller treats it as fatal.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from minisgl_mp.distributed.shard import TPShard

logger = logging.getLogger(__name__)


class TPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, cpu_group: object | None) -> None:
        self.rank = rank
        self.size = size
        self.device = device  # where the model's collectives run
        self._cpu_group = cpu_group  # None: the default (gloo) group

    @classmethod
    def join(cls, rank: int, size: int, init_addr: str, device: torch.device, timeout_s: float) -> TPGroup:
        """Join the group at `init_addr` (host:port; rank 0 listens there). Blocks until all
        `size` ranks have joined, or `timeout_s`."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", world_size=size, rank=rank,
                                timeout=timedelta(seconds=timeout_s))
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
        logger.info("rank %d of %d joined the %s group at %s", rank, size, backend, init_addr)
        return cls(rank, size, device, cpu_group)

    @property
    def shard(self) -> TPShard:
        return TPShard(self.rank, self.size)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- the model's collectives (on its device) ------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank 0's columns first."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    # ---- host-side agreement -------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None). One small broadcast when it is
        empty, two otherwise."""
        size = torch.tensor([len(data) if self.is_leader and data else 0], dtype=torch.int64)
        dist.broadcast(size, 0, group=self._cpu_group)
        n = int(size.item())
        if n == 0:
            return b""
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_leader and data
               else torch.empty(n, dtype=torch.uint8))
        dist.broadcast(buf, 0, group=self._cpu_group)
        return data if self.is_leader and data else buf.numpy().tobytes()

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank; every rank passes a list of the same length."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, 0, group=self._cpu_group)
        return t.tolist()

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
