"""Errors a user can fix. The CLI prints them as one line and exits with code 2 (``--debug`` shows the traceback)."""

from __future__ import annotations

import reprlib
from typing import Any

MAX_ERROR_CHARS = 1_000  # an error line longer than this is cut (the rest is counted, not printed)
MAX_QUOTE_CHARS = 80  # what an error quotes of a user's value


def quote(value: Any) -> str:
    """A user's value as an error line quotes it: its repr, cut to about :data:`MAX_QUOTE_CHARS` characters in
    bounded time (a nested value shows its first levels and items; a huge integer its size). Examples:
    ``quote("a" * 500)`` -> ``"'aaa...aaa'"`` (80 characters), ``quote(10**5000)``
    -> ``"an integer of about 5001 digits"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"  # log10(2): no str() of it
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = MAX_QUOTE_CHARS
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 6, 6, 6, 6
    text = r.repr(value)
    return text if len(text) <= 2 * MAX_QUOTE_CHARS else text[:MAX_QUOTE_CHARS] + "..."


def cap_line(message: str) -> str:
    """``message`` cut to :data:`MAX_ERROR_CHARS` characters, saying how long it was."""
    if len(message) <= MAX_ERROR_CHARS:
        return message
    return f"{message[:MAX_ERROR_CHARS]}... [cut: {len(message)} characters in all]"


class LorarlError(Exception):
    """A problem with the user's input (recipe, dataset, file, checkpoint), stated so they can fix it. The line is
    capped (:func:`cap_line`); values from the user are quoted with :func:`quote`."""

    def __init__(self, *args: Any):
        if len(args) == 1 and isinstance(args[0], str):
            args = (cap_line(args[0]),)
        super().__init__(*args)


class RecipeError(LorarlError):
    """A recipe key is unknown, has the wrong type or is out of range. The message names the key and the file."""


class DataError(LorarlError):
    """A dataset row is unusable. The message names the row index and the column."""
