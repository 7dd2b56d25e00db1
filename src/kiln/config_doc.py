"""`kiln config show CONFIG [KEY=VALUE ...]`: the resolved config as YAML, each key with its description and
default, and a mark on what the file or the overrides changed. Read from the pydantic models themselves, so
it never drifts from what is validated."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from kiln.config import Config


def _yaml_value(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(mode="json") for v in value]
    return "null" if value is None else json.dumps(value, ensure_ascii=False) if not isinstance(value, bool) \
        else str(value).lower()


def _default(field) -> Any:
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def describe(model: BaseModel, indent: int = 0) -> list[str]:
    """Lines of YAML for `model`: `key: value  # [changed] description (default D)`; sections recurse."""
    lines = []
    pad = "  " * indent
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            doc = (type(value).__doc__ or "").strip().splitlines()
            lines.append(f"{pad}{name}:" + (f"  # {doc[0]}" if doc and doc[0] else ""))
            lines += describe(value, indent + 1)
            continue
        default = "required" if field.is_required() else _yaml_value(_default(field))
        shown = _yaml_value(value)
        changed = not field.is_required() and shown != default
        notes = [n for n in (field.description, f"default {default}") if n]
        lines.append(f"{pad}{name}: {shown}  # {'* ' if changed else ''}{'; '.join(notes)}")
    return lines


def show(cfg: Config) -> str:
    return "\n".join(["# kiln config show: the resolved config; '*' marks a value that differs from the default",
                      *describe(cfg)])
