"""Keeps the schedulers of the tensor-parallel ranks in step.

Only rank 0 listens to the tokenizer. At every turn of the loop it broadcasts what arrived
(msgpack bytes of the scheduler channel's own messages, possibly none) and every rank handles
the same messages in the same order; the schedulers are deterministic, so every rank then
builds the same batch and runs the same step. An idle rank 0 still broadcasts every poll
interval, so a rank that is gone is noticed within one interval, busy or not.
"""

from __future__ import annotations

import msgpack

from minisgl_mp.distributed.group import TPGroup
from minisgl_mp.message.messages import SCHEDULER_CHANNEL


class RankSync:
    def __init__(self, group: TPGroup) -> None:
        self.group = group

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    def share(self, msgs: list[object] | None) -> list[object]:
        """Rank 0 passes this turn's messages and gets them back; the others pass None and
        get rank 0's."""
        if self.is_leader:
            self.group.broadcast_bytes(msgpack.packb([SCHEDULER_CHANNEL.encode(m) for m in msgs]) if msgs else None)
            return list(msgs or [])
        data = self.group.broadcast_bytes(None)
        if not data:
            return []
        return [SCHEDULER_CHANNEL.decode(b) for b in msgpack.unpackb(data)]
