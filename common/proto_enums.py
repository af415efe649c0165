"""A Python enum's members as the values of the ``keel.proto`` enum it mirrors, and
back: member ``NAME`` is the proto value ``PREFIX_NAME``. The Python enum keeps the
strings operators see and etcd stores; the wire carries the proto enum. Built once per
enum, next to it, and checked when built: both sides name the same values, so one
cannot gain a value the other lacks."""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.protobuf.message import Message

Member = TypeVar("Member", bound=enum.Enum)

# Every mirrored enum, by the proto enum's full name: what ``message_dict`` shows.
_MIRRORED: dict[str, ProtoEnum] = {}


class ProtoEnum(Generic[Member]):
    def __init__(self, python: type[Member], wire: EnumTypeWrapper, prefix: str):
        """``python``'s members are ``wire``'s values named ``prefix`` + the member's
        name, and ``wire`` has no other value but ``prefix + "UNSPECIFIED"`` (0)."""
        self.python, self.wire = python, wire
        self._to_wire = {member: wire.Value(prefix + member.name) for member in python}
        self._from_wire = {value: member for member, value in self._to_wire.items()}
        unmatched = set(wire.keys()) - {wire.Name(v) for v in self._from_wire}
        if unmatched != {prefix + "UNSPECIFIED"} or wire.Value(prefix + "UNSPECIFIED") != 0:
            raise TypeError(
                f"{python.__name__} and {wire.DESCRIPTOR.name} differ: "
                f"{sorted(unmatched - {prefix + 'UNSPECIFIED'})} have no member"
            )
        _MIRRORED[wire.DESCRIPTOR.full_name] = self

    def to_wire(self, member: Member) -> int:
        """The proto value of ``member``."""
        return self._to_wire[member]

    def from_wire(self, value: int) -> Member:
        """The member of proto value ``value``; ValueError for UNSPECIFIED (a field
        left unset) or a value this build does not know."""
        try:
            return self._from_wire[value]
        except KeyError:
            raise ValueError(
                f"{self.wire.DESCRIPTOR.name} value {value} is no {self.python.__name__}"
            ) from None

    def from_text(self, text: str) -> int:
        """The proto value of the member whose string is ``text`` (what an operator
        writes: "replace"); ValueError for any other text."""
        return self.to_wire(self.python(text))

    def text(self, value: int) -> str:
        """What an operator reads for proto value ``value``: its member's string, ""
        for UNSPECIFIED (as an unset string field read before)."""
        member = self._from_wire.get(value)
        return "" if member is None else member.value


def mirror(enum_type: EnumDescriptor) -> ProtoEnum | None:
    """The ProtoEnum of the proto enum ``enum_type``, or None if no Python enum mirrors it
    (or the module that builds its mirror was not imported)."""
    return _MIRRORED.get(enum_type.full_name)


def message_dict(message: Message) -> dict:
    """``message`` as JSON-ready data for an operator: every field by its proto name
    (unset ones too), and each enum field as its Python member's string rather than
    the proto value's name."""
    data = json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        use_integers_for_enums=True,
    )
    _shown(message.DESCRIPTOR, data)
    return data


def _shown(descriptor, data: dict) -> None:
    for field in descriptor.fields:
        if field.name not in data:
            continue
        if field.type == FieldDescriptor.TYPE_ENUM:
            value, kind = data[field.name], field.enum_type
            data[field.name] = (
                [_enum_text(kind, v) for v in value]
                if isinstance(value, list)
                else _enum_text(kind, value)
            )
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            value = data[field.name]
            if field.message_type.GetOptions().map_entry:
                inner = field.message_type.fields_by_name["value"]
                if inner.type == FieldDescriptor.TYPE_MESSAGE:
                    for entry in value.values():
                        _shown(inner.message_type, entry)
            elif isinstance(value, list):
                for entry in value:
                    _shown(field.message_type, entry)
            elif isinstance(value, dict):
                _shown(field.message_type, value)


def _enum_text(enum_type, value: int) -> str:
    mirrored = _MIRRORED.get(enum_type.full_name)
    if mirrored is not None:
        return mirrored.text(value)
    known = enum_type.values_by_number.get(value)
    return known.name if known is not None else str(value)
