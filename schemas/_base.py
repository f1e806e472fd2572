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
import glob
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
import msgpack

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
        if len(set(args)) == 1:
            # fastjsonschema (used by check_schema) does not enforce the 2020-12 `prefixItems`; a fixed-length tuple
            # of one type is said with `items` + length instead, which both drafts and both validators enforce
            return {"type": "array", "items": _type_schema(args[0]), "minItems": len(args), "maxItems": len(args)}
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


def json_schema(root: type, *, format_name: str, format_version: int, title: str,
                trailer: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON Schema document of a file whose top-level object mirrors `root`.

    `trailer`: required top-level fields after the dataclass's (e.g. the schedule's content digest).
    """
    defs: dict[str, Any] = {}
    _collect(root, defs)
    top = dict(defs.pop(root.__name__))
    top["properties"] = {
        "format": {"const": format_name},
        "format_version": {"const": format_version},
        **top["properties"],
        **(trailer or {}),
    }
    top["required"] = ["format", "format_version", *top["required"], *(trailer or {})]
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
    if cls is int and isinstance(data, float):
        return int(data)  # JSON Schema counts 3.0 as an integer; keep the dataclass field an int
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
        path, expected, found = _explain(exc)
        raise FormatError(kind, source, path, f"{expected}, found {found}", fix) from None


def _explain(exc: Any) -> tuple[str, str, str]:
    """(field path, what was expected, what was found) of a fastjsonschema failure, in plain words."""
    path = _schema_path(exc)
    rule, rule_value, definition = exc.rule, exc.rule_definition, exc.definition or {}
    found = _short(exc.value)
    if rule == "additionalProperties" and isinstance(exc.value, dict):
        known = list(definition.get("properties", {}))
        unknown = [k for k in exc.value if k not in known]
        name = unknown[0] if unknown else "?"
        where = _join_path(path, name)
        return where, f"no unknown fields (known here: {', '.join(known)})", f"unknown field {name!r}"
    if rule == "required" and isinstance(exc.value, dict):
        missing = [k for k in rule_value if k not in exc.value]
        name = missing[0] if missing else "?"
        return _join_path(path, name), f"a required field ({_describe(definition.get('properties', {}).get(name, {}))})", "it missing"
    if rule == "propertyNames" and isinstance(exc.value, dict):
        allowed = (rule_value or {}).get("enum", [])
        bad = [k for k in exc.value if k not in allowed]
        return path, f"keys from {'/'.join(map(str, allowed))}", f"key {_short(bad[0] if bad else exc.value)}"
    if rule in ("anyOf", "oneOf"):
        return path, " or ".join(_describe(option) for option in rule_value), found
    if rule == "type":
        return path, _describe({"type": rule_value}), f"{found} ({_json_type(exc.value)})"
    if rule in _BOUNDS:
        return path, f"{_BOUNDS[rule]} {rule_value}", found
    if rule == "minItems":
        return path, f"a list of at least {rule_value} item{'s' if rule_value != 1 else ''}", found
    if rule == "maxItems":
        return path, f"a list of at most {rule_value} items", found
    if rule == "minLength":
        return path, "a non-empty string" if rule_value == 1 else f"a string of at least {rule_value} characters", found
    return path, _describe({rule: rule_value}) if rule else "a valid value", found


_BOUNDS = {"minimum": "a number >=", "exclusiveMinimum": "a number >", "maximum": "a number <=", "exclusiveMaximum": "a number <"}
_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "array": "a list", "object": "a map", "null": "null (nothing)"}


def _describe(schema: Any) -> str:
    """A JSON Schema fragment in words, e.g. 'one of FORWARD/BACKWARD/OPTIMIZER'."""
    if not isinstance(schema, dict) or not schema:
        return "any value"
    if "enum" in schema:
        return "one of " + "/".join(str(v) for v in schema["enum"])
    if "const" in schema:
        return repr(schema["const"])
    if "$ref" in schema:
        return f"a map ({schema['$ref'].rsplit('/', 1)[-1]})"
    if "anyOf" in schema:
        return " or ".join(_describe(option) for option in schema["anyOf"])
    if "pattern" in schema:
        return f"a string matching {schema['pattern']}"
    words = _TYPE_WORDS.get(schema.get("type", ""), "a valid value")
    bounds = [f"{_BOUNDS[k].split()[-1]} {schema[k]}" for k in _BOUNDS if k in schema]
    return words + (f" {' and '.join(bounds)}" if bounds else "")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "map"
    if value is None:
        return "null"
    return type(value).__name__


def _schema_path(exc: Any) -> str:
    # exc.name is "data.layout.chunks[3].id": fastjsonschema's own rendering, indexes in brackets
    name = exc.name or "data"
    name = name.removeprefix("data").lstrip(".")
    return name or "(top level)"


def _join_path(path: str, name: str) -> str:
    return name if path == "(top level)" else f"{path}.{name}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# The integers every format carries: signed 64-bit. TOML's own range (toml.io v1.0.0, "Integer":
# "Arbitrary 64-bit signed integers ... should be accepted and handled losslessly"), msgpack's signed
# range (its unsigned one reaches 2**64 - 1, which no consumer holds: torch sizes, numpy and OR-Tools
# CP-SAT coefficients are int64). Beyond it a value is refused at the boundary, naming the field,
# instead of surfacing as msgpack's "OverflowError: Integer value out of range" when a digest is
# computed (hardware fuzz cases 1066...2687 of issue 21: `k = 1e+300` in an integer field).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_numbers(kind: str, source: str, obj: Any, *, fix: str) -> None:
    """Every float field of a dataclass tree is finite (JSON Schema bounds let NaN through) and every
    integer field fits a signed 64-bit integer (JSON Schema counts 1e300 as an integer).

    Free-form fields typed `Any` (e.g. a model config) are not checked: they are not numbers tide uses.
    """
    for path, value in _numbers(obj, ""):
        where = path or "(top level)"
        if isinstance(value, float):
            require(math.isfinite(value), kind, source, where, f"a finite number, found {value}", fix)
        else:
            require(INT64_MIN <= value <= INT64_MAX, kind, source, where,
                    f"an integer between -2**63 and 2**63-1 (64-bit), found {_huge(value)}", fix)


def _huge(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{float(value):.3g}" if abs(value) < 2**1023 else f"an integer of {len(text)} digits"


def _numbers(obj: Any, path: str) -> typing.Iterator[tuple[str, float | int]]:
    if isinstance(obj, float) or (isinstance(obj, int) and not isinstance(obj, (bool, enum.Enum))):
        yield path, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        hints = _hints(type(obj))
        for f in dataclasses.fields(obj):
            if _is_free_form(hints[f.name]):
                continue
            yield from _numbers(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            yield from _numbers(item, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _numbers(item, f"{path}.{key.value if isinstance(key, enum.Enum) else key}")


def _is_free_form(hint: Any) -> bool:
    return hint is Any or (typing.get_origin(hint) is dict and typing.get_args(hint)[1] is Any)


def require(condition: bool, kind: str, source: str, path: str, message: str, fix: str = "") -> None:
    """The one semantic-rule helper: raise a FormatError unless `condition` holds."""
    if not condition:
        raise FormatError(kind, source, path, message, fix)


def format_bytes(n: float) -> str:
    """A byte count in the unit that shows its digits: 512 B, 12.3 KB, 45.6 MB, 1.23 GB (decimal units).

    Never "0.00 GB" for a small model (issue 21); three significant digits.
    """
    value = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{int(value)} B" if value == int(value) else f"{value:.3g} B"


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
    """Write to a temp file in the same folder, fsync, rename, fsync the folder: readers never see half
    a file, and after a crash (power loss included) the name holds the old file or the new one.

    A temp file of an earlier write of the same target that was killed before its rename (SIGKILL
    runs no cleanup) is removed first: one writer per target, so it can only be stale.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(target)
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
        fsync_directory(target.parent)  # the rename itself is durable only once the folder is (ext4/xfs)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def remove_stale_temp_files(target: Path) -> list[Path]:
    """Delete `.<name>.*.tmp` left in `target`'s folder by a killed `atomic_write_bytes`; returns them."""
    stale = list(target.parent.glob(f".{glob_escape(target.name)}.*.tmp"))
    for tmp in stale:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
    return stale


def glob_escape(name: str) -> str:

    return glob.escape(name)


def fsync_directory(folder: Path) -> None:
    """fsync a folder so a rename or unlink in it survives a crash (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on a directory; the rename is done anyway
    finally:
        os.close(fd)


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
    if not payload:
        raise FormatError(kind, source, "", "a msgpack document, found an empty file", fix)
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except msgpack.ExtraData as exc:
        raise FormatError(kind, source, "", f"one msgpack object, found {len(exc.extra)} trailing bytes after it", fix) from None
    except (msgpack.UnpackException, ValueError, TypeError, UnicodeDecodeError) as exc:
        detail = " ".join(str(exc).split())[:80] or type(exc).__name__  # msgpack's reason, on one line
        what = "truncated" if "incomplete" in detail.lower() or "insufficient" in detail.lower() else "corrupt"
        raise FormatError(kind, source, "", f"a msgpack document, found {what} data (msgpack: {detail})", fix) from None


def pack_msgpack(data: Any) -> bytes:
    return msgpack.packb(data, use_bin_type=True)
