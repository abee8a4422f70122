"""Detokenizer process: token ids in, text deltas out."""

from __future__ import annotations

from minisgl_mp.detokenizer.incremental import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
