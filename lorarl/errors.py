"""Errors a user can fix. The CLI prints them as one line and exits with code 2 (``--debug`` shows the traceback)."""

from __future__ import annotations


class LorarlError(Exception):
    """A problem with the user's input (recipe, dataset, file, checkpoint), stated so they can fix it."""


class RecipeError(LorarlError):
    """A recipe key is unknown, has the wrong type or is out of range. The message names the key and the file."""


class DataError(LorarlError):
    """A dataset row is unusable. The message names the row index and the column."""
