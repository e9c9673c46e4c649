"""Key patterns (`kvpool ls`, `rm --regex`, remove_by_regex, list_objects): RE2 syntax, matched in
time linear in the key, so that no pattern holds the master (Python's backtracking `re` took
26 s for `^(a+)+$` on a key of 28 characters and one more, doubling with each: the nodes'
heartbeats went unanswered and the master dropped them). No backreferences or lookaround."""

from __future__ import annotations

import re2

from kvpool import limits
from kvpool.errors import InvalidParams

OPTIONS = re2.Options()
OPTIONS.log_errors = False  # a bad pattern is the caller's InvalidParams, not a log line


def compile_pattern(pattern: str) -> re2._Regexp:
    """The compiled pattern. Raises InvalidParams: too long, or not RE2 syntax."""
    if type(pattern) is not str or len(pattern.encode(errors="replace")) > limits.REGEX_SIZE_BYTES_MAX:
        raise InvalidParams(f"pattern longer than {limits.REGEX_SIZE_BYTES_MAX} bytes")
    try:
        pattern.encode()
    except UnicodeEncodeError:  # a lone surrogate: bytes of a command line that are not UTF-8
        raise InvalidParams(f"pattern must be valid UTF-8 text: {pattern!r:.100}") from None
    try:
        return re2.compile(pattern, options=OPTIONS)
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise InvalidParams(f"bad pattern {pattern[:200]!r} (RE2 syntax): {why}") from None
