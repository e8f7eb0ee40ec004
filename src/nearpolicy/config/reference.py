"""`nearpolicy config`: every config key with its default, its range or choices, and its doc, read from the schema
itself (config/schema.py: field defaults, pydantic constraints, Literal choice lists, registries; docs are the strings
under the fields), so the reference cannot drift from what validation accepts. Also a whole config written back as
TOML (`config_toml`, what `nearpolicy train --dry-run` prints)."""

from __future__ import annotations

import json
import math
import re
import textwrap
import typing
from pathlib import Path

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from nearpolicy.config.schema import Config
from nearpolicy.config.checks import RegisteredName

BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))


def _toml(value) -> str:
    """A default as it would be written in the TOML file ("unset" for None, which TOML cannot write)."""
    if value is None:
        return "unset"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _toml_key(key) -> str:
    """A TOML key: bare when it can be (letters, digits, _ and -), else quoted (e.g. "blk.0-2")."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", str(key)) else json.dumps(str(key))


def config_toml(cfg: Config) -> str:
    """`cfg` as a TOML file that load_config reads back to the same config: a table per section, every key written;
    a key that is unset (None) is written as a comment, since TOML cannot write None."""
    out = []
    for section, values in cfg.model_dump().items():
        out.append(f"[{section}]")
        out += [f"# {key} = unset" if value is None else f"{key} = {_toml(value)}" for key, value in values.items()]
        out.append("")
    return "\n".join(out)


def _literals(annotation) -> list[str]:
    """The Literal choices inside an annotation (through `X | None`, dict values, Annotated)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return [c for arg in typing.get_args(annotation) for c in _literals(arg)]


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def allowed(info: FieldInfo) -> str:
    """The field's choices or range in words, e.g. "one of: a, b" or ">= 0, < 1"; "" when any value of its type goes."""
    names = [m for m in info.metadata if isinstance(m, RegisteredName)]
    choices = names[0].names() if names else _literals(info.annotation)
    if choices:
        return "one of: " + ", ".join(choices)
    bounds = [f"{sign} {_number(getattr(m, attr))}" for m in info.metadata for kind, attr, sign in BOUNDS
              if isinstance(m, kind)]
    patterns = [m.pattern for m in info.metadata if getattr(m, "pattern", None)]
    return ", ".join(bounds + [f"matches {p}" for p in patterns])


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return text or str(annotation).replace("typing.", "").replace("pathlib.", "")


def config_reference(width: int = 100) -> str:
    """The reference text: per section its doc, then per key `section.key = default  [type; range or choices]` and
    the key's doc, wrapped to `width`. "unset" is None: leave the key out of the file."""
    out = ["nearpolicy config keys: `section.key = default  [type; range or choices]`, then what the key does.",
           "Set them in the TOML file's [section] tables or with --set section.key=value; unset = leave the key out.",
           ""]
    for section, section_info in Config.model_fields.items():
        model: type[BaseModel] = section_info.annotation
        out += [f"[{section}]", *textwrap.wrap(" ".join((model.__doc__ or "").split()), width, break_on_hyphens=False), ""]
        for key, info in model.model_fields.items():
            default = info.get_default(call_default_factory=True)
            rule, kind = allowed(info), _type_name(info.annotation)
            if rule.startswith("one of"):
                kind, rule = ("dict", "values " + rule) if typing.get_origin(info.annotation) is dict else ("choice", rule)
            line = f"{section}.{key} = {_toml(default)}    [{kind}{'; ' + rule if rule else ''}]"
            out += textwrap.wrap(line, width, initial_indent="  ", subsequent_indent="        ", break_on_hyphens=False)
            doc = " ".join((info.description or "").split())
            out += textwrap.wrap(doc, width, initial_indent="      ", subsequent_indent="      ",
                                 break_on_hyphens=False)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def undocumented() -> list[str]:
    """Keys without a doc string (the tests keep this empty)."""
    return [f"{section}.{key}" for section, s in Config.model_fields.items()
            for key, info in s.annotation.model_fields.items() if not (info.description or "").strip()]
