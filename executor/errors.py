"""Errors the executor's CLI turns into one line and exit code 2, never a traceback."""

from __future__ import annotations


class ExecutorError(Exception):
    """A problem with the user's model, batch or files that the executor explains (exit code 2).

    The message is one line: what (which module, tensor, file or field), what was expected, and the fix.
    """

    exit_code = 2

