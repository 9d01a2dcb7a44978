"""Config dicts to dataclasses, refusing unknown keys, for every config we read: a typo fails loudly with
the known names instead of being ignored."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Self


def reject_unknown(data: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Raise ValueError naming the keys of `data` that are not in `known`, and the known ones."""
    known = sorted(known)
    if unknown := sorted(set(data) - set(known)):
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {known}")


def from_dict(cls, data: Mapping[str, Any] | None, *, where: str | None = None,
              nested: Mapping[str, type] | None = None):
    """`cls(**data)` for a dataclass `cls` after reject_unknown; `nested` {field: dataclass with its own
    from_dict} converts sub-dicts."""
    where = where or cls.__name__
    if data is not None and not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping of fields, got {data!r}")
    data = dict(data or {})
    reject_unknown(data, (f.name for f in dataclasses.fields(cls)), where)
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in (nested or {}) and not _type_ok(value, hints[key]):
            raise ValueError(f"{where}.{key} must be {_type_name(hints[key])}, got {value!r}")
    for key, sub in (nested or {}).items():
        if key in data and not isinstance(data[key], sub):
            data[key] = sub.from_dict(data[key])
    return cls(**data)


class FromDict:
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self:
        return from_dict(cls, data)


_SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether `value` fits a scalar annotation (or a union of them); others are checked where used."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint in _SCALARS:  # YAML's true is not a number, nor "false" a bool
        return isinstance(value, _SCALARS[hint]) and (hint is bool or not isinstance(value, bool))
    return True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def check_choices(obj) -> None:
    """Raise ValueError naming the field where a `Literal[...]` field of dataclass `obj` holds another value."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if typing.get_origin(hints[f.name]) is Literal:
            choices, value = typing.get_args(hints[f.name]), getattr(obj, f.name)
            if value not in choices:
                raise ValueError(f"{type(obj).__name__}.{f.name} must be one of {list(choices)}, got {value!r}")
