"""Shared machinery of the three file formats: errors, dataclass <-> plain data, JSON Schema, IO.

The dataclasses in `trace.py`, `hardware.py` and `schedule.py` are the single source of truth;
the JSON Schema documents (`schemas/*.schema.json`, the published contract) are generated from
them by `python -m schemas.generate` and a test checks that the committed documents are current.
Field constraints live in `field(metadata=...)` under the JSON Schema keywords they become.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import fastjsonschema

SCHEMA_DIR = Path(__file__).resolve().parent
T = TypeVar("T")


class FormatError(ValueError):
    """A file (or an object about to be written) does not satisfy its format.

    The message is one line: `invalid <kind>: <file>: <field path>: <what was expected>, found <what>.
    <fix>`. CLIs print it and exit 2; nothing deeper ever reaches the user as a traceback.
    """

    def __init__(self, kind: str, source: str, path: str, message: str, fix: str = "") -> None:
        self.kind, self.source, self.path, self.message, self.fix = kind, source, path, message, fix
        where = f"{source}: " if source else ""
        field_path = f"{path}: " if path else ""
        tail = f" Fix: {fix}" if fix else ""
        super().__init__(f"invalid {kind}: {where}{field_path}{message}.{tail}")


def frozen(cls: type[T]) -> type[T]:
    """The one dataclass decorator of the formats (DESIGN.md §8.1)."""
    return dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(cls)


def constrained(**keywords: Any) -> Any:
    """A dataclass field carrying JSON Schema keywords (minimum, exclusiveMinimum, pattern...)."""
    default = keywords.pop("default", dataclasses.MISSING)
    factory = keywords.pop("default_factory", dataclasses.MISSING)
    return dataclasses.field(default=default, default_factory=factory, metadata={"json": keywords})


# ----------------------------------------------------------------------------- JSON Schema


def _type_schema(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = _type_schema(options[0]) if len(options) == 1 else {"anyOf": [_type_schema(a) for a in options]}
        return {"anyOf": [inner, {"type": "null"}]} if type(None) in args else inner
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0])}
        return {"type": "array", "prefixItems": [_type_schema(a) for a in args], "minItems": len(args), "maxItems": len(args)}
    if origin is dict:
        key, value = args
        schema: dict[str, Any] = {"type": "object", "additionalProperties": _type_schema(value)}
        if isinstance(key, type) and issubclass(key, enum.Enum):
            schema["propertyNames"] = {"enum": [m.value for m in key]}
        return schema
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"type": "string", "enum": [m.value for m in hint]}
    if dataclasses.is_dataclass(hint):
        return {"$ref": f"#/$defs/{hint.__name__}"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is str:
        return {"type": "string"}
    if hint is Any:
        return {}
    raise TypeError(f"no JSON Schema for {hint!r}")


def _collect(cls: type, defs: dict[str, Any]) -> None:
    if cls.__name__ in defs:
        return
    defs[cls.__name__] = {}  # reserve before recursing (self-references)
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        prop = _type_schema(hints[f.name])
        prop.update(f.metadata.get("json", {}))
        if f.default is not dataclasses.MISSING:
            prop["default"] = f.default.value if isinstance(f.default, enum.Enum) else f.default
        else:
            required.append(f.name)
        properties[f.name] = prop
        for nested in _nested_dataclasses(hints[f.name]):
            _collect(nested, defs)
    doc = (cls.__doc__ or "").strip().splitlines()
    defs[cls.__name__] = {
        "type": "object",
        "description": doc[0] if doc else cls.__name__,
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _nested_dataclasses(hint: Any) -> list[type]:
    if dataclasses.is_dataclass(hint):
        return [hint]
    return [c for a in typing.get_args(hint) for c in _nested_dataclasses(a)]


def json_schema(root: type, *, format_name: str, format_version: int, title: str) -> dict[str, Any]:
    """The JSON Schema document of a file whose top-level object mirrors `root`."""
    defs: dict[str, Any] = {}
    _collect(root, defs)
    top = dict(defs.pop(root.__name__))
    top["properties"] = {
        "format": {"const": format_name},
        "format_version": {"const": format_version},
        **top["properties"],
    }
    top["required"] = ["format", "format_version", *top["required"]]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://tide.invalid/schemas/{format_name}.v{format_version}.schema.json",
        "title": title,
        **top,
        "$defs": dict(sorted(defs.items())),
    }


# ----------------------------------------------------------------------------- plain data


def to_plain(obj: Any) -> Any:
    """Dataclass tree -> msgpack/JSON-able dicts, lists and scalars (field order kept)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    return obj


def from_plain(cls: Any, data: Any) -> Any:
    """Plain data already checked against the JSON Schema -> dataclass tree."""
    origin = typing.get_origin(cls)
    args = typing.get_args(cls)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        options = [a for a in args if a is not type(None)]
        return from_plain(options[0], data)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_plain(args[0], v) for v in data)
        return tuple(from_plain(a, v) for a, v in zip(args, data))
    if origin is dict:
        return {from_plain(args[0], k): from_plain(args[1], v) for k, v in data.items()}
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        return cls(data)
    if dataclasses.is_dataclass(cls):
        hints = _hints(cls)
        return cls(**{name: from_plain(hints[name], value) for name, value in data.items() if name in hints})
    if cls is float and isinstance(data, int):
        return float(data)
    return data


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ----------------------------------------------------------------------------- validation


@functools.cache
def compiled_validator(schema_file: str) -> Any:
    with open(SCHEMA_DIR / schema_file, encoding="utf-8") as fh:
        return fastjsonschema.compile(json.load(fh))


def check_schema(kind: str, source: str, schema_file: str, data: Any, *, fix: str) -> None:
    """Validate plain data against the committed JSON Schema; one clear line on failure."""
    try:
        compiled_validator(schema_file)(data)
    except fastjsonschema.JsonSchemaValueException as exc:
        path = _schema_path(exc)
        found = _short(exc.value)
        expected = exc.message.removeprefix(exc.name or "").strip() if exc.message else "a valid value"
        if exc.rule == "additionalProperties":
            expected = "no unknown fields"
        raise FormatError(kind, source, path, f"{expected}, found {found}", fix) from None


def _schema_path(exc: Any) -> str:
    parts = list(exc.path or [])
    if parts and parts[0] == "data":
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def require(condition: bool, kind: str, source: str, path: str, message: str, fix: str = "") -> None:
    """The one semantic-rule helper: raise a FormatError unless `condition` holds."""
    if not condition:
        raise FormatError(kind, source, path, message, fix)


def finite_positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_header(kind: str, source: str, data: Any, format_name: str, version: int, fix_other_version: str) -> None:
    """`format` and `format_version` first, so another format or version gets its own message."""
    require(isinstance(data, dict), kind, source, "(top level)", f"a map with format={format_name!r}, found {type(data).__name__}",
            f"is this a {format_name} file?")
    found_format = data.get("format")
    require(found_format == format_name, kind, source, "format",
            f"{format_name!r}, found {found_format!r}", f"pass a {format_name} file here")
    found_version = data.get("format_version")
    require(isinstance(found_version, int) and not isinstance(found_version, bool), kind, source, "format_version",
            f"an integer, found {found_version!r}", fix_other_version)
    if found_version != version:
        newer = found_version > version
        raise FormatError(kind, source, "format_version",
                          f"{format_name} format {found_version}, this tide reads format {version}",
                          ("upgrade tide (pip install -U tide) or " if newer else "") + fix_other_version)


# ----------------------------------------------------------------------------- IO


def atomic_write_bytes(path: str | os.PathLike[str], payload: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers never see half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a written file gets the usual permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_bytes(kind: str, path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FormatError(kind, str(path), "", "a readable file, found no such file", "check the path") from None
    except IsADirectoryError:
        raise FormatError(kind, str(path), "", "a file, found a directory", "pass the file, not its folder") from None
    except PermissionError:
        raise FormatError(kind, str(path), "", "a readable file, found permission denied", "check the file's permissions") from None


def digest_bytes(payload: bytes) -> str:
    return "sha256:" + hashlib.sha256(payload).hexdigest()


def unpack_msgpack(kind: str, source: str, payload: bytes, fix: str) -> Any:
    """Decode msgpack strictly: truncated, corrupt or trailing bytes are one clear error."""
    import msgpack

    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except msgpack.ExtraData:
        raise FormatError(kind, source, "", "one msgpack object, found trailing bytes after it", fix) from None
    except (msgpack.UnpackException, ValueError, TypeError, UnicodeDecodeError) as exc:
        what = "truncated" if "incomplete" in str(exc).lower() or "insufficient" in str(exc).lower() else "corrupt"
        raise FormatError(kind, source, "", f"a msgpack document, found {what} data ({type(exc).__name__})", fix) from None


def pack_msgpack(data: Any) -> bytes:
    import msgpack

    return msgpack.packb(data, use_bin_type=True)
