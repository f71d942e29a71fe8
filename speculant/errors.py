"""Errors raised for bad user input.

Every error names the bad value and what is allowed; the CLI turns a
:class:`SpeculantError` into a one-line message and exit code 2.
"""

import numbers
import re
from contextlib import contextmanager


class SpeculantError(ValueError):
    """Bad input from a user (model name, option value, prompt length...)."""


def check_range(name: str, value, low=None, high=None, *, low_open=False, high_open=False):
    """Raise :class:`SpeculantError` unless ``low (<|<=) value (<|<=) high`` (NaN never is).

    Returns ``value`` so the call can be used inline.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SpeculantError(f"{name}={value!r} is invalid; allowed: a number")
    bad = value != value                  # NaN is never in range
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        lo = "-inf" if low is None else str(low)
        hi = "inf" if high is None else str(high)
        lb = "(" if low_open or low is None else "["
        hb = ")" if high_open or high is None else "]"
        raise SpeculantError(f"{name}={value!r} is out of range; allowed: {lb}{lo}, {hi}{hb}")
    return value


@contextmanager
def naming_flags(names, renames: dict[str, str] | None = None):
    """Within it, a :class:`SpeculantError` that names one of the settings ``names`` (or a key of ``renames``) as a
    config's checks do (``name=value ...``) is re-raised naming the command-line flag the user typed instead:
    ``--name-with-dashes=value ...``, or ``renames[name]=value ...`` where the flag's name differs.  For the
    ``from_args`` of the CLIs' configs: the Python API keeps the field names, the CLI says the flags."""
    renames = renames or {}
    try:
        yield
    except SpeculantError as e:
        m = re.match(r"([a-z][a-z0-9_]*)=", str(e))
        if m is None or (m.group(1) not in names and m.group(1) not in renames):
            raise
        flag = renames.get(m.group(1), "--" + m.group(1).replace("_", "-"))
        raise SpeculantError(flag + str(e)[m.end(1):]) from None
