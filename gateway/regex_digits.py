"""``\\d`` read as the ASCII digits [0-9] in the regexes that hold structured output.

llguidance reads a regex as Rust's regex crate does, where ``\\d`` is any
Unicode decimal digit: ``\\d{3}`` admits ``🯸🯸🯸`` (and a sampling model finds
such tokens). Someone who asks for digits means 0-9, which is also what
``\\d`` means in a JSON schema ``pattern`` (ECMA-262, and llguidance's JSON
compiler reads it so). Regexes are rewritten before they reach the engine:
``\\d`` becomes ``[0-9]`` and ``\\D`` ``[^0-9]``, inside character classes
too (``[\\dA-F]`` becomes ``[0-9A-F]``; ``[\\D]`` a nested class, which Rust's
syntax allows). An escaped backslash (``\\\\d``) is a backslash and a ``d``,
and stays so.
"""

from __future__ import annotations

_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]"}
_INSIDE = {"d": "0-9", "D": "[^0-9]"}


def ascii_digits(pattern: str) -> str:
    """``pattern`` with every ``\\d`` / ``\\D`` escape spelled as an ASCII class; the rest unchanged."""
    out: list[str] = []
    depth = 0  # nesting of character classes at this point
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            table = _INSIDE if depth else _OUTSIDE
            out.append(table.get(e, c + e))
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[":
            depth += 1
            # A "]" first in a class (after an optional "^") is a literal, not its end.
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":
                out.append("]")
                i += 1
        elif c == "]" and depth:
            depth -= 1
    return "".join(out)
