"""What a command tells the user: `UserError` for bad input, one line for it and for file-system errors
(`user_message`). `UserError` is a `ValueError`, so library callers that catch `ValueError` keep working;
inside the validation boundary `user_input()` a plain `ValueError` is about the input, outside it a bug.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator


class UserError(ValueError):
    """A mistake in the input (an option, a path, a checkpoint): one line, exit status 2, nothing written."""


def one_line(err: BaseException) -> str:
    """The first line of an error's message (its type name when it has none)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


@contextlib.contextmanager
def user_input() -> Iterator[None]:
    """Inside: a ValueError (e.g. from a library check or `int("x")`) becomes a UserError, same message."""
    try:
        yield
    except UserError:
        raise
    except ValueError as err:
        raise UserError(one_line(err)) from err


def user_message(err: BaseException) -> str | None:
    """The one line for a user mistake (UserError) or a file-system error (OSError: 'PATH: No such file or
    directory', or its own message when it names no path); None for a bug."""
    if isinstance(err, UserError) or (isinstance(err, OSError) and err.filename is None):
        return one_line(err)
    if not isinstance(err, OSError):
        return None
    what = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else str(err.filename)
    return f"{what}: {err.strerror or one_line(err)}"


def check_number(flag: str, value, *, minimum: float = 0, inclusive: bool = False, integer: bool = False):
    """`value` if it is a finite number > `minimum` (>= with `inclusive`), an integer where `integer`; else a
    UserError naming the flag, the value and the range. None passes (an option left unset)."""
    if value is None:
        return value
    kind = "integer" if integer else "number"
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum or (inclusive and value == minimum))
    if not ok or (integer and not float(value).is_integer()):
        raise UserError(f"{flag} must be a finite {kind} {bound}, got {value!r}")
    return value


SEED_MAX = 2**32 - 1  # numpy's and `accelerate.utils.set_seed`'s bound


def check_seed(value, flag: str = "--seed"):
    """`value` if it is an integer seed every generator takes ([0, 2**32 - 1]); else a UserError naming the
    flag and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise UserError(f"{flag} must be an integer in [0, {SEED_MAX}], got {value!r}")
    return value
