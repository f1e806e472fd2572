"""The committed JSON Schema documents are current, valid Draft 2020-12, and enforced by fastjsonschema.

`schemas/_base.check_schema` validates with fastjsonschema, which has no 2020-12 generator of its
own (it uses its 2019-09 one for any newer `$schema`); the generator therefore only emits keywords
that mean the same in both drafts, and the probes below check that each one is really enforced.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import fastjsonschema
import pytest
from jsonschema import Draft202012Validator

from conftest import REPO
from schemas import FormatError, _base
from schemas.generate import DOCUMENTS, render
from schemas.schedule import seal
from strategies import example_hardware, example_schedule, example_trace

# keywords fastjsonschema's 2019-09 generator enforces exactly as Draft 2020-12 defines them,
# plus annotations it may ignore; `prefixItems` (2020-12 only) would be silently ignored, so never emit it
SUPPORTED = {
    "$schema", "$id", "$defs", "$ref", "title", "description", "default",  # structure and annotations
    "type", "enum", "const", "properties", "required", "additionalProperties", "propertyNames", "items",
    "anyOf", "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minItems", "maxItems", "minLength", "pattern",
}


def _keywords(node: Any, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            out.add(key)
            if key in ("properties", "$defs"):
                for sub in value.values():
                    _keywords(sub, out)
            elif key not in ("enum", "const", "default", "required"):
                _keywords(value, out)
    elif isinstance(node, list):
        for item in node:
            _keywords(item, out)
    return out


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_committed_document_is_current(name: str) -> None:
    assert (REPO / "schemas" / name).read_text(encoding="utf-8") == render(name), "run `python -m schemas.generate`"


def test_generate_check_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "schemas.generate", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_document_is_valid_draft_2020_12(name: str) -> None:
    doc = json.loads((REPO / "schemas" / name).read_text(encoding="utf-8"))
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(doc)
    unsupported = _keywords(doc, set()) - SUPPORTED
    assert not unsupported, f"keywords fastjsonschema may not enforce: {sorted(unsupported)}"


@pytest.mark.parametrize("name, document", [
    ("trace.schema.json", lambda: example_trace()),
    ("schedule.schema.json", lambda: example_schedule()),
    ("hardware.schema.json", lambda: example_hardware()),
])
def test_both_validators_agree_on_a_valid_document(name: str, document: Any) -> None:
    root, fmt, version, _ = DOCUMENTS[name]
    data = {"format": fmt, "format_version": version, **_base.to_plain(document())}
    if name == "schedule.schema.json":
        data = seal(data)
    doc = json.loads((REPO / "schemas" / name).read_text(encoding="utf-8"))
    Draft202012Validator(doc).validate(data)
    fastjsonschema.compile(doc)(data)


def _plain_schedule() -> dict[str, Any]:
    root, fmt, version, _ = DOCUMENTS["schedule.schema.json"]
    return seal({"format": fmt, "format_version": version, **_base.to_plain(example_schedule())})


def _set(data: dict[str, Any], keys: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    target = data
    for key in keys[:-1]:
        target = target[key]
    target[keys[-1]] = value
    return data


# one probe per keyword the generator emits: both validators must reject it, and so must check_schema
PROBES = [
    ("type", ("budgets", "device_bytes"), "1"),
    ("type-bool-is-not-int", ("budgets", "device_bytes"), True),
    ("enum", ("actions", 0, "op"), "TELEPORT"),
    ("const", ("format",), "tide.other"),
    ("$ref/additionalProperties", ("layout", "chunks", 0, "colour"), 1),
    ("additionalProperties-top", ("colour",), 1),
    ("required", ("header",), {}),
    ("propertyNames", ("prediction", "peak_bytes_per_tier"), {"GPU": 1}),
    ("additionalProperties-map-values", ("prediction", "peak_bytes_per_tier"), {"DEVICE": "a lot"}),
    ("items", ("stages", 0), 7),
    ("anyOf-null", ("actions", 0, "src"), "SOMEWHERE"),
    ("minimum", ("layout", "chunks", 0, "owner_rank"), -1),
    ("minItems", ("moments",), []),
    ("minLength", ("header", "policy"), ""),
    ("pattern", ("header", "hardware_digest"), "sha256:xyz"),
]


@pytest.mark.parametrize("label, keys, value", PROBES, ids=[p[0] for p in PROBES])
def test_every_keyword_is_enforced(label: str, keys: tuple[Any, ...], value: Any) -> None:
    bad = _set(_plain_schedule(), keys, value)
    doc = json.loads((REPO / "schemas" / "schedule.schema.json").read_text(encoding="utf-8"))
    assert not Draft202012Validator(doc).is_valid(bad), "the probe itself is wrong"
    with pytest.raises(fastjsonschema.JsonSchemaValueException):
        fastjsonschema.compile(doc)(bad)
    with pytest.raises(FormatError):
        _base.check_schema("schedule", "probe", "schedule.schema.json", bad, fix="x")


def test_exclusive_minimum_and_maximum_are_enforced() -> None:
    from schemas._base import to_plain
    from schemas.generate import DOCUMENTS as D

    _, fmt, version, _ = D["hardware.schema.json"]
    good = {"format": fmt, "format_version": version, **to_plain(example_hardware())}
    for keys, value, word in [(("device", "memory_gb"), 0.0, "> 0"), (("host", "usable_fraction"), 1.01, "<= 1")]:
        with pytest.raises(FormatError, match=word):
            _base.check_schema("hardware profile", "probe", "hardware.schema.json", _set(good, keys, value), fix="x")


def test_fixed_length_tuples_are_enforced_by_fastjsonschema() -> None:
    """A future `tuple[int, int]` field must not fall back to `prefixItems`, which fastjsonschema ignores."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **_base._type_schema(tuple[int, int])}
    Draft202012Validator.check_schema(schema)
    assert "prefixItems" not in schema
    check = fastjsonschema.compile(schema)
    check([1, 2])
    for bad in ([1], [1, 2, 3], [1, "a"]):
        with pytest.raises(fastjsonschema.JsonSchemaValueException):
            check(bad)
