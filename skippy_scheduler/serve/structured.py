"""`response_format` to a GBNF grammar for llama.cpp's grammar sampler.

`{"type": "text"}` (or none) constrains nothing. `{"type": "json_object"}` is llama.cpp's JSON
grammar (an object at the top, as OpenAI's JSON mode promises). `{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}, "strict": ...}}` converts the schema with the
converter llama-cpp-python ships (`llama_cpp.llama_grammar.json_schema_to_gbnf`, a translation
of llama.cpp's own `json_schema_to_grammar`). A schema the converter cannot handle is a 400
naming the deepest part of it that fails on its own (`response_format.json_schema.schema.
properties.when`, say), with the converter's complaint; remote `$ref`s are not fetched. A
count (minLength, maxLength, minItems, maxItems, a pattern's `{m,n}`) above `MAX_COUNT` is a
400 before anything is converted. Strings hold nothing JSON must escape (`json_safe`): the
converter's string character admitted control characters, and a pattern's `.` and classes a
quote or a backslash; a pattern whose literal characters include them is a 400. Nor do they hold
what no UTF-8 text holds (surrogates, values past U+10FFFF), in `json_object` mode too. A
pattern's `\\d \\w \\s \\D \\W \\S` are written out as classes before the converter sees them.

The grammar is checked once more by the host's grammar sampler before the request is queued
(a `GrammarCheckingHost`'s `check_grammar`, such as `LlamaHost`'s), so nothing the sampler cannot
parse reaches a sampler chain; a host without the check judges the request in its
`prepare_sequence`. The converter is imported when a request first asks for a grammar.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional

from .errors import RequestError

_WHERE = "response_format"
_SCHEMA_PATH = "response_format.json_schema.schema"
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def grammar_of(value: Any) -> Optional[str]:
    """The GBNF grammar `response_format` asks for (None: unconstrained text)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError("'response_format' must be an object with a 'type'", param=_WHERE)
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        key = sorted(extra)[0]
        raise RequestError(f"'response_format.{key}' is not a field of response_format",
                           param=f"{_WHERE}.{key}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise RequestError("'response_format.type' must be 'text', 'json_object' or "
                           f"'json_schema', got {kind!r}", param=f"{_WHERE}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("'response_format.json_schema' must be an object with a 'schema'",
                           param=f"{_WHERE}.json_schema")
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        key = sorted(unknown)[0]
        raise RequestError(f"'response_format.json_schema.{key}' is not a field of json_schema",
                           param=f"{_WHERE}.json_schema.{key}")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not 0 < len(name) <= 64
                             or not set(name) <= _NAME_CHARS):
        raise RequestError("'response_format.json_schema.name' must be 1 to 64 letters, digits, "
                           "'_' or '-'", param=f"{_WHERE}.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError("'response_format.json_schema.schema' must be a JSON schema object",
                           param=_SCHEMA_PATH)
    return convert(schema)


# The string character of the JSON grammar llama-cpp-python ships, which admits what no UTF-8
# text holds (see _UNSAFE).
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F]'


def json_object_grammar() -> str:
    """llama.cpp's JSON grammar (an object at the top) with its string character kept to what
    a JSON string holds as it is in UTF-8. RuntimeError where the shipped grammar's string
    character is not the one this rewrites (another llama-cpp-python)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    if JSON_GBNF.count(_JSON_CHAR) != 1:
        raise RuntimeError("llama_cpp's JSON grammar has no string character "
                           f"{_JSON_CHAR}: json_object mode cannot be kept to UTF-8")
    return str(JSON_GBNF).replace(_JSON_CHAR, f"[^{_UNSAFE_CLASS}]")


# Keywords the converter passes over without enforcing them: an output could break them, so a
# schema that uses one is refused (naming where) rather than answered with invalid output.
UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minProperties", "maxProperties", "uniqueItems", "not", "contains", "minContains",
    "maxContains", "patternProperties", "propertyNames", "dependentRequired",
    "dependentSchemas", "dependencies", "if", "then", "else", "unevaluatedProperties",
    "unevaluatedItems"})


# The most copies a count in a schema may ask for (minLength, maxLength, minItems, maxItems,
# a pattern's {m,n}). The converter writes one grammar element per copy, so a count of 10^9 in
# a 100-byte request took gigabytes; llama.cpp's grammar parser refuses a rule repeated 2 000
# times or more, and a maxLength of 30 000 (as many nested groups) overflowed its stack.
MAX_COUNT = 1000
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
# A pattern's braces: every number in them counts (the converter reads `{,N}` and `{+N}` too).
_QUANTIFIER = re.compile(r"\{[^{}]*\}")
_NUMBER = re.compile(r"\d+")
# Keywords whose values are data, not schemas (a const object is not walked).
_DATA = frozenset({"const", "enum", "default", "examples"})
# Keywords holding subschemas: by name, one, or a list (`items` is either).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_CHILD_KEYS = frozenset(_SCHEMA_MAPS + _SCHEMA_ONE + _SCHEMA_LISTS)


def convert(schema: dict[str, Any]) -> str:
    """`schema` as GBNF, or a 400 naming the part the converter fails on or would not
    enforce."""
    _check_enforced(schema, ())
    try:
        return _convert(schema)
    except RecursionError:
        failure = "it nests too deeply"
    except Exception as exc:  # the converter asserts, raises KeyError, ValueError, TypeError...
        failure = _complaint(exc)
    path, message = _deepest(schema, (), failure)
    where = _where(path)
    raise RequestError(f"'{where}' cannot be turned into a grammar: {message}", param=where)


def _where(path: tuple[Any, ...]) -> str:
    return _SCHEMA_PATH + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _check_enforced(schema: Any, path: tuple[Any, ...]) -> None:
    """A 400 for the first keyword the grammar would not enforce, or a count past
    `MAX_COUNT`."""
    if not isinstance(schema, dict):
        return
    for key in sorted(UNENFORCED & set(schema)):
        where = _where(path + (key,))
        raise RequestError(f"'{where}': the grammar cannot enforce '{key}', so an output could "
                           "break it; leave it out of the schema", param=where)
    for key in _COUNTS:
        count = schema.get(key)
        if isinstance(count, (int, float)) and not isinstance(count, bool) \
                and count > MAX_COUNT:
            where = _where(path + (key,))
            raise RequestError(f"'{where}' may be at most {MAX_COUNT} for a grammar, got "
                               f"{count}", param=where)
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        _check_literals(pattern, path + ("pattern",))
        for m in _QUANTIFIER.finditer(pattern):
            count = max((int(n) for n in _NUMBER.findall(m.group())), default=0)
            if count > MAX_COUNT:
                where = _where(path + ("pattern",))
                raise RequestError(f"'{where}' repeats {m.group()}: a grammar takes at most "
                                   f"{MAX_COUNT} repetitions", param=where)
    for sub_path, sub in _children(schema):
        _check_enforced(sub, path + sub_path)
    # A `$ref` may point anywhere in the document ("#/x"), so an object under a key that is no
    # keyword is walked as a schema too.
    for key, value in schema.items():
        if key in _CHILD_KEYS or key in _DATA:
            continue
        if isinstance(value, dict):
            _check_enforced(value, path + (key,))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                _check_enforced(item, path + (key, i))


def _check_literals(pattern: str, path: tuple[Any, ...]) -> None:
    """A 400 for a pattern whose literal characters (outside a character class) hold a quote,
    a backslash or a control character: the grammar writes a pattern's characters inside the
    JSON string as they are, where those must be escaped (`json_safe` keeps the classes to
    what a string may hold)."""
    # Classes do not nest: a class ends at its first unescaped `]`, as the converter reads it.
    in_class = False
    i = 0
    bad = None
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            if not in_class:
                if nxt in _UNSAFE_ESCAPES:
                    bad = "\\" + nxt
                elif nxt in ("x", "u"):
                    digits = pattern[i + 2:i + (4 if nxt == "x" else 6)]
                    try:
                        code = int(digits, 16)
                    except ValueError:
                        code = -1
                    if any(lo <= code <= hi for lo, hi in _UNSAFE):
                        bad = "\\" + nxt + digits
                if bad is not None:
                    break
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif any(lo <= ord(c) <= hi for lo, hi in _UNSAFE):
            bad = repr(c)
            break
        i += 1
    if bad is not None:
        where = _where(path)
        raise RequestError(f"'{where}' matches {bad}, a character the grammar would write into "
                           "the JSON string unescaped (only a character class may hold such "
                           "characters, and they are left out of it)", param=where)


# Pattern escapes for characters a JSON string must escape (quote, backslash, controls).
_UNSAFE_ESCAPES = frozenset('"\\nrtfv0')


def _convert(schema: dict[str, Any]) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_safe(json_schema_to_gbnf(json.dumps(_spelled_out(schema))))


# A pattern's class escapes as JSON Schema's regular expressions (ECMA-262) mean them, written
# as the ranges the converter passes on to the grammar (it copies `\d` into a literal, which
# llama.cpp's grammar parser refuses). `\s` keeps its control characters here; `json_safe`
# leaves them out of the class, as a JSON string holds them only escaped.
_SHORTHANDS = {
    "d": "0-9", "w": "0-9A-Za-z_",
    "s": r" \t\n\r\x0B\x0C\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFEFF"}


def _spelled_out(schema: Any) -> Any:
    r"""`schema` with every `pattern`'s `\d \w \s \D \W \S` written as classes (a copy;
    `schema` is left as it is)."""
    if isinstance(schema, list):
        return [_spelled_out(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            out[key] = shorthands_spelled_out(value)
        else:
            out[key] = _spelled_out(value)
    return out


def shorthands_spelled_out(pattern: str) -> str:
    r"""`pattern` with `\d \w \s` and their negations `\D \W \S` as character classes (inside
    a class, as its ranges). ValueError for a negation inside a class beside anything else:
    one class of a grammar cannot say "not a digit, or an a" (the caller makes it a 400
    naming the pattern)."""
    out: list[str] = []
    opened = -1  # where the class being read starts in `out` (-1: outside one)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            ranges = _SHORTHANDS.get(nxt.lower())
            if ranges is None:
                out.append(pattern[i:i + 2])
            elif opened < 0:
                out.append(f"[{'^' if nxt.isupper() else ''}{ranges}]")
            elif nxt.islower():
                out.append(ranges)
            elif len(out) == opened + 1 and pattern.startswith("]", i + 2):
                # [\D] is [^0-9], and [^\D] is [0-9]
                out[opened] = "[" if out[opened] == "[^" else "[^"
                out.append(ranges)
            else:
                raise ValueError(f"\\{nxt} stands in a character class beside other "
                                 "characters; a grammar's class cannot hold a negation")
            i += 2
            continue
        if opened >= 0:
            if c == "]":
                opened = -1
        elif c == "[":
            opened = len(out)
            c = "[^" if pattern.startswith("[^", i) else "["
            i += len(c) - 1
        out.append(c)
        i += 1
    return "".join(out)


# What a JSON string may not hold as it is: the quote, the backslash and the control characters
# (and DEL, which llama.cpp's own JSON grammar leaves out as well); and what no UTF-8 text
# holds, though llama.cpp's grammar decodes byte tokens that spell it as code points: the
# surrogates, and values past U+10FFFF up to the largest a four-byte lead spells (0x3FFFFF).
_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF),
           (0x110000, 0x3FFFFF))
_UNSAFE_CLASS = r'"\\\x7F\x00-\x1F\uD800-\uDFFF\U00110000-\U003FFFFF'
# The converter's string character admits the control characters, and its `.` the quote and
# the backslash: both written as the JSON grammar llama.cpp ships has them.
_SAFE_RULES = {
    "char": f'char ::= [^{_UNSAFE_CLASS}] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F] '
            '[0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])',
    "dot": f"dot ::= [^{_UNSAFE_CLASS}]",
}
_ESCAPES = {"t": 0x09, "r": 0x0D, "n": 0x0A, "\\": 0x5C, '"': 0x22, "[": 0x5B, "]": 0x5D}
_HEX = {"x": 2, "u": 4, "U": 8}
_MAX_CODE = 0x3FFFFF


def json_safe(grammar: str) -> str:
    """The converter's grammar with nothing a JSON string must escape left unescaped inside
    one: its string character and `.` rules rewritten, and every character class a schema's
    `pattern` made (they stand inside a string's quotes) kept to what a JSON string may hold
    as it is (a negated class excludes those characters too; a class that holds nothing
    else is a ValueError). The literal characters of a pattern are checked on the pattern
    (`_check_pattern`)."""
    out = []
    for line in grammar.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            out.append(line)
        elif name in _SAFE_RULES:
            out.append(_SAFE_RULES[name])
        elif name == "space":
            out.append(line)  # (whitespace between tokens, outside every string)
        else:
            out.append(f"{name} ::= {_safe_classes(body)}")
    return "\n".join(out) + "\n"


def _safe_classes(body: str) -> str:
    """`body` with each character class outside its string literals made JSON-safe."""
    parts = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':  # a literal, as it is
            j = i + 1
            while j < n and body[j] != '"':
                j += 2 if body[j] == "\\" else 1
            parts.append(body[i:j + 1])
            i = j + 1
        elif c == "[":
            ranges, negated, j = _read_class(body, i + 1)
            parts.append(_write_class(ranges, negated))
            i = j
        else:
            parts.append(c)
            i += 1
    return "".join(parts)


def _read_class(body: str, i: int) -> tuple[list[tuple[int, int]], bool, int]:
    """The ranges of the class whose text starts at `body[i]` (after its `[`), whether it is
    negated, and the index past its `]`."""
    negated = body.startswith("^", i)
    i += negated
    ranges: list[tuple[int, int]] = []
    while i < len(body) and body[i] != "]":
        lo, i = _read_char(body, i)
        hi = lo
        if body.startswith("-", i) and not body.startswith("-]", i):
            hi, i = _read_char(body, i + 1)
        ranges.append((lo, hi))
    if i >= len(body):
        raise ValueError(f"a character class is not closed in {body!r}")
    return ranges, negated, i + 1


def _read_char(body: str, i: int) -> tuple[int, int]:
    if body[i] != "\\":
        return ord(body[i]), i + 1
    kind = body[i + 1:i + 2]
    if kind in _HEX:
        width = _HEX[kind]
        return int(body[i + 2:i + 2 + width], 16), i + 2 + width
    if kind in _ESCAPES:
        return _ESCAPES[kind], i + 2
    raise ValueError(f"unknown escape \\{kind} in a character class")


def _write_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    if negated:  # it excludes what a JSON string must escape as well
        return "[^" + "".join(_write_range(lo, hi) for lo, hi in ranges) + _UNSAFE_CLASS + "]"
    kept = ranges
    for bad_lo, bad_hi in _UNSAFE:
        kept = [piece for lo, hi in kept for piece in
                ((lo, min(hi, bad_lo - 1)), (max(lo, bad_hi + 1), hi)) if piece[0] <= piece[1]]
    if not kept:
        raise ValueError("a pattern's character class holds only characters a JSON string "
                         "must escape (the quote, the backslash, control characters)")
    return "[" + "".join(_write_range(lo, hi) for lo, hi in kept) + "]"


def _write_range(lo: int, hi: int) -> str:
    return _write_char(lo) if lo == hi else f"{_write_char(lo)}-{_write_char(hi)}"


def _write_char(code: int) -> str:
    if 0x20 < code < 0x7F and chr(code) not in '\\]["^-':
        return chr(code)
    if code <= 0xFF:
        return f"\\x{code:02X}"
    if code <= 0xFFFF:
        return f"\\u{code:04X}"
    return f"\\U{min(code, _MAX_CODE):08X}"


def _complaint(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _failure(schema: Any) -> Optional[str]:
    """The converter's complaint about `schema` taken alone, or None when it converts."""
    try:
        _convert(schema)
    except RecursionError:
        return "it nests too deeply"
    except Exception as exc:  # the converter asserts, raises KeyError, ValueError, TypeError...
        return _complaint(exc)
    return None


def _deepest(schema: Any, path: tuple[Any, ...], message: str) -> tuple[tuple[Any, ...], str]:
    """The deepest sub-schema under `schema` that fails alone (its path, its complaint)."""
    for sub_path, sub in _children(schema):
        if not isinstance(sub, dict) or _refers(sub):
            continue  # a $ref only resolves against the whole schema
        failure = _failure(sub)
        if failure is not None:
            return _deepest(sub, path + sub_path, failure)
    return path, message


def _children(schema: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield (key, name), sub
    for key in _SCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            yield (key,), schema[key]
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                yield (key, i), sub


def _refers(schema: Any) -> bool:
    return "$ref" in json.dumps(schema)
