"""The base of raycolo's kinds: an enum whose members are their text.

A :class:`TextEnum` member is a ``str`` equal to, hashed as, printed and formatted as its
value (what Python 3.11's ``enum.StrEnum`` does; raycolo supports 3.10), so a kind can go
into messages, JSON and f-strings unchanged, and a caller that still passes the text is
understood."""
from __future__ import annotations

import enum


class TextEnum(str, enum.Enum):
    __str__ = str.__str__
    __format__ = str.__format__
