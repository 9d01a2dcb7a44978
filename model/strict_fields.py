"""Config dicts to dataclasses, refusing unknown keys: one rule for every config file we read (model and
training configs, the Serve config's args, engine settings, `user_config`), so a typo fails loudly with
the known names instead of being ignored."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal


def reject_unknown(data: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """Raise ValueError naming the keys of `data` that are not in `known`, and the known ones."""
    known = sorted(known)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {known}")


def from_dict(cls, data: Mapping[str, Any] | None, *, where: str | None = None,
              nested: Mapping[str, type] | None = None):
    """`cls(**data)` for a dataclass `cls` after reject_unknown; `nested` {field: dataclass with its own
    from_dict} converts sub-dicts."""
    data = dict(data or {})
    reject_unknown(data, (f.name for f in dataclasses.fields(cls)), where or cls.__name__)
    for key, sub in (nested or {}).items():
        if key in data and not isinstance(data[key], sub):
            data[key] = sub.from_dict(data[key])
    return cls(**data)


def check_choices(obj) -> None:
    """Raise ValueError naming the field where a `Literal[...]` field of dataclass `obj` holds another value."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if typing.get_origin(hints[f.name]) is Literal:
            choices, value = typing.get_args(hints[f.name]), getattr(obj, f.name)
            if value not in choices:
                raise ValueError(f"{type(obj).__name__}.{f.name} must be one of {list(choices)}, got {value!r}")
