"""Command-line flags generated from frozen config dataclasses: one source of defaults."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Union


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the non-None type, whether None is allowed)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp, _ = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        required = f.default is dataclasses.MISSING
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=tp, required=required,
                               default=None if required else f.default,
                               help=help_text + ("" if required else f" (default: {f.default})"))


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
