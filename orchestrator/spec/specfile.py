"""Job spec files for ``keel submit SPEC``: TOML or YAML, checked against the JobSpec proto.

The schema is ``keel_pb2.JobSpec.DESCRIPTOR``, so a field added to the proto is accepted
here without a change. An enum field is written as its Python enum's string
(``straggler_policy = "alert"``, ``common.proto_enums``), not as the proto value's name.
Every problem is reported at once, one line each, as
``FILE: FIELD.PATH: what is wrong and how to fix it``.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from pathlib import Path

import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from common.proto_enums import mirror
from orchestrator.spec import jobspec
from protos import keel_pb2

SUFFIXES = (".toml", ".yaml", ".yml")
_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_FLOATS = (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT)
_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
    type(None): "null",
}


class SpecFileError(ValueError):
    """A spec file that cannot be submitted; one line per problem, each naming the file."""


def load(path: str | Path) -> keel_pb2.JobSpec:
    """The validated JobSpec in a ``.toml``, ``.yaml`` or ``.yml`` file; raises SpecFileError."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise SpecFileError(
            f"{path}: unsupported file type {path.suffix or '(none)'!r}; "
            f"write the spec as {', '.join(SUFFIXES)}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise SpecFileError(f"{path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecFileError(f"{path}: not UTF-8 text; save the spec as UTF-8") from None
    try:
        data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise SpecFileError(f"{path}: TOML syntax error: {exc}") from None
    except yaml.YAMLError as exc:
        raise SpecFileError(f"{path}: YAML syntax error{_yaml_where(exc)}") from None
    return parse(data, str(path))


def parse(data: object, source: str) -> keel_pb2.JobSpec:
    """The validated JobSpec in ``data``, a spec file's loaded top-level mapping.

    ``source`` names the file in errors. Raises SpecFileError listing every structural
    problem or, when the structure is sound, every problem ``jobspec.validate`` finds.
    """
    if not isinstance(data, dict):
        raise _error(
            source,
            [
                f"the top level must be a mapping of JobSpec fields "
                f"(name, world_size, command, ...), got {_show(data)}"
            ],
        )
    problems: list[str] = []
    _check_message(data, keel_pb2.JobSpec.DESCRIPTOR, "", problems)
    if problems:
        raise _error(source, problems)
    try:
        spec = json_format.ParseDict(
            _proto_spelling(data, keel_pb2.JobSpec.DESCRIPTOR), keel_pb2.JobSpec()
        )
    except json_format.ParseError as exc:  # a value the checks above let through
        raise _error(source, [str(exc)]) from None
    try:
        jobspec.validate(spec)
    except jobspec.InvalidSpec as exc:
        raise _error(source, exc.problems) from None
    return spec


def _error(source: str, problems: list[str]) -> SpecFileError:
    return SpecFileError("\n".join(f"{source}: {problem}" for problem in problems))


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is None:  # a reader error (bad bytes) has no position
        return f": {exc}"
    what = ", ".join(filter(None, (exc.context, exc.problem)))
    return f" at line {mark.line + 1}, column {mark.column + 1}: {what}"


def _check_message(data: object, descriptor: Descriptor, path: str, problems: list[str]) -> None:
    """Appends to ``problems`` every way ``data`` does not fit the message ``descriptor``."""
    names = list(descriptor.fields_by_name)
    if not isinstance(data, dict):
        problems.append(
            f"{path}: expected a mapping of its fields ({', '.join(names)}), got {_show(data)}"
        )
        return
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        field = descriptor.fields_by_name.get(key)
        if field is None:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {', '.join(names)}"
            problems.append(f"{where}: unknown field {str(key)!r}; {hint}")
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            if not isinstance(value, dict):
                problems.append(f"{where}: expected a mapping, got {_show(value)}")
                continue
            entry = field.message_type.fields_by_name
            for k, v in value.items():
                _check_value(k, entry["key"], f"{where}.{k}", problems)
                _check_value(v, entry["value"], f"{where}.{k}", problems)
        elif field.is_repeated:
            if not isinstance(value, list):
                hint = (
                    f"; write it as a list, e.g. {json.dumps(value.split())}"
                    if isinstance(value, str)
                    else ""
                )
                problems.append(f"{where}: expected a list, got {_show(value)}{hint}")
                continue
            for i, item in enumerate(value):
                _check_value(item, field, f"{where}[{i}]", problems)
        else:
            _check_value(value, field, where, problems)


def _check_value(value: object, field: FieldDescriptor, where: str, problems: list[str]) -> None:
    """Appends to ``problems`` why ``value`` cannot be one value of ``field``, if it cannot."""
    if field.message_type is not None:
        _check_message(value, field.message_type, where, problems)
        return
    kind, number = field.cpp_type, isinstance(value, (int, float)) and not isinstance(value, bool)
    problem = None
    if kind == FieldDescriptor.CPPTYPE_STRING and not isinstance(value, str):
        quote = f'; quote it: "{json.dumps(value)}"' if isinstance(value, (int, float)) else ""
        problem = f"expected a string, got {_show(value)}{quote}"
    elif kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        if not number or isinstance(value, float):
            problem = f"expected an integer, got {_show(value)}"
        elif value < low:
            unsigned = " (the field is unsigned)" if low == 0 else ""
            problem = f"must be at least {low}{unsigned}, got {value}"
        elif value > high:
            problem = f"must be at most {high}, got {value}"
    elif kind in _FLOATS and not number:
        problem = f"expected a number, got {_show(value)}"
    elif kind in _FLOATS and not _finite(value):
        problem = f"expected a finite number, got {_show(value)}"
    elif kind == FieldDescriptor.CPPTYPE_BOOL and not isinstance(value, bool):
        problem = f"expected true or false, got {_show(value)}"
    elif kind == FieldDescriptor.CPPTYPE_ENUM and value not in _spellings(field):
        problem = f"expected one of {', '.join(_spellings(field))}, got {_show(value)}"
    if problem:
        problems.append(f"{where}: {problem}")


def _spellings(field: FieldDescriptor) -> list[str]:
    """How a spec file writes the values of the enum ``field``: its Python enum's
    strings, or the proto's value names for an enum no Python enum mirrors."""
    mirrored = mirror(field.enum_type)
    if mirrored is None:
        return [v.name for v in field.enum_type.values if v.number != 0]
    return [member.value for member in mirrored.python]


def _proto_spelling(data: dict, descriptor: Descriptor) -> dict:
    """``data``, checked, with each enum value written as the proto value's name, which
    is what ``json_format`` reads."""
    out = dict(data)
    for key, value in data.items():
        field = descriptor.fields_by_name[key]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # JobSpec's maps hold strings only
        if field.is_repeated:
            out[key] = [_proto_value(item, field) for item in value]
        else:
            out[key] = _proto_value(value, field)
    return out


def _proto_value(value: object, field: FieldDescriptor) -> object:
    if field.message_type is not None:
        return _proto_spelling(value, field.message_type)
    mirrored = mirror(field.enum_type) if field.enum_type is not None else None
    if mirrored is None:
        return value
    return field.enum_type.values_by_number[mirrored.from_text(value)].name


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer with hundreds of digits
        return False


def _show(value: object) -> str:
    """How a loaded value reads in an error: its kind, and the value itself when scalar."""
    if value is None or isinstance(value, (list, dict)):
        return _KINDS[type(value)]
    kind = _KINDS.get(type(value), f"a {type(value).__name__}")
    return f"{kind} {json.dumps(value, default=str)}"
