"""Errors the library raises for mistakes a user can make.

Every error names the problem (the value, what was expected and what was given) so that the CLI can print it
on one line and callers can catch one type. They subclass ``ValueError`` because they all describe bad input.
"""

from __future__ import annotations


class LatticeError(ValueError):
    """Base class of every error raised for bad input or an unsupported setup."""


class ConfigError(LatticeError):
    """An option or a combination of options is invalid (e.g. ``min_ngram > max_ngram``).

    ``param`` names the option at fault where the message is about one of a pair (``min_ngram``), so that a
    front-end can point at it (the server's 400 ``param``)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(LatticeError):
    """A model directory is missing, unreadable, or not a transformers causal LM."""


class UnsupportedModelError(LatticeError):
    """The model's cache cannot be rolled back exactly, so speculation would not be lossless."""


class TokenError(LatticeError):
    """A token id lies outside the vocabulary, or a sequence is empty or too long."""
