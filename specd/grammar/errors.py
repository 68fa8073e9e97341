"""The grammar errors, in one place so that services can map each to one status code.

GrammarCompileError  the user's grammar cannot be compiled (a request error: HTTP 400 /
                     INVALID_ARGUMENT).
GrammarViolation     a committed token is not allowed by the grammar: the engine committed a token
                     the masks forbid, which is a bug (INTERNAL).
GrammarNotOpenError  a step names a sequence with no open matcher (NOT_FOUND / FAILED_PRECONDITION).
"""

from __future__ import annotations

from specd.messages import ConfigError


class GrammarCompileError(ConfigError):
    """A GrammarSpec that xgrammar cannot compile; the message says what is wrong with it."""


class GrammarViolation(RuntimeError):
    """A token committed to a matcher that the grammar does not allow."""


class GrammarNotOpenError(LookupError):
    """A sequence id with no open matcher."""
