"""Argument validators shared by the public types, the native faces and the reference.

Every public entry point validates before it changes anything, so these raise TypeError for a
wrong kind of value and ValueError for a value outside its domain.
"""
from __future__ import annotations

import gc
import json
import math
import operator
from typing import Any

# Compiled fast path for lists/tuples of exact ints (the common case); it returns None for
# anything else, which the general loop below then handles.
from ._boundary import check_tokens_fast as _check_tokens_fast

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
USIZE_MAX = U64_MAX
I32_MIN = -(1 << 31)
I32_MAX = (1 << 31) - 1
#: The largest time in milliseconds a target or bound takes (11.6 days), from a flag or a
#: request: a larger one overflows when the core turns it into µs, and means nothing.
MAX_MS = 1e9


def as_float(value: Any) -> float:
    """`float(value)` of a real number (int, float, numbers.Real), an int past a double's range
    read as the infinity of its sign (float() raises OverflowError there): a finiteness check
    then refuses it as it refuses inf, with a ValueError."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def sat(value: int) -> int:
    """Clamp a non-negative int to u64, counters saturate instead of wrapping (docs/behaviour.md §1.0)."""
    return value if value <= U64_MAX else U64_MAX


def sat_sub(a: int, b: int) -> int:
    return a - b if a > b else 0


def as_int(name: str, value: object) -> int:
    """Accept Python and numpy integers; reject bools (they are not token or count values)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # index() is the check
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _exact_int(name: str, value: object) -> int:
    """Only a Python int (numpy integers and bools rejected), returned as it is."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _range_error(name: str, number: int, lo: int, hi: int | None) -> ValueError:
    bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    return ValueError(f"{name} must be {bound}, got {number}")


def check_int(name: str, value: object, lo: int, hi: int | None = None, *,
              exact: bool = False) -> int:
    """An int in [lo, hi] (no upper bound when `hi` is None).

    Python and numpy integers are accepted and returned as a Python int (`as_int`); with
    `exact`, only a Python int, returned as it is. Bools are rejected either way.
    """
    number = _exact_int(name, value) if exact else as_int(name, value)
    if number < lo or (hi is not None and number > hi):
        raise _range_error(name, number, lo, hi)
    return number


def check_uint(name: str, value: object, limit: int = U64_MAX, *, exact: bool = False) -> int:
    """`check_int(name, value, 0, limit)`, without the extra call (it is on every `Sequence`)."""
    number = _exact_int(name, value) if exact else as_int(name, value)
    if number < 0 or number > limit:
        raise _range_error(name, number, 0, limit)
    return number


def check_optional_uint(name: str, value: object, limit: int = U64_MAX) -> int | None:
    return None if value is None else check_uint(name, value, limit)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        kind = type(value)  # named in full where the short name is "bool" too (numpy's)
        shown = (kind.__name__ if kind.__module__ == "builtins"
                 else f"{kind.__module__}.{kind.__qualname__}")
        raise TypeError(f"{name} must be a Python bool (True or False), got {shown}")
    return value


def check_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def check_id(name: str, value: object) -> str:
    """A sequence id: any str that has a UTF-8 encoding (the native core keys ids by those bytes)."""
    text = check_str(name, value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be encodable as UTF-8 (lone surrogates are not)") from None
    return text


def check_tokens(name: str, values: object) -> list[int]:
    """A token list: ints in [0, 2**31 - 1] (§0.7); returns a fresh list."""
    fast = _check_tokens_fast(name, values)
    if fast is not None:
        return fast
    if isinstance(values, (str, bytes, bytearray, memoryview)) or values is None:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None
    out = []
    for position, item in enumerate(items):
        token = as_int(f"{name}[{position}]", item)
        if token < 0 or token > I32_MAX:
            raise ValueError(f"{name}[{position}] = {token} is outside the token range [0, {I32_MAX}]")
        out.append(token)
    return out


def json_loads(text: str | bytes) -> Any:
    """`json.loads(text)` with the cyclic collector held off meanwhile. A document nested as
    deep as the parser goes runs it near Python's recursion limit, where a finalizer the
    collector happened to run (any object's, from anywhere) would fail in turn and print
    "Exception ignored" on stderr, under the one line a user error is (RecursionError and
    ValueError as json.loads raises them)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return json.loads(text)
    finally:
        if enabled:
            gc.enable()
