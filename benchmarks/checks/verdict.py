"""What a GPU check may call a pass: limits from an error analysis, and one PASS or FAIL line each.

    from benchmarks.checks.verdict import Verdicts, rounding_limit, accumulation_limit

Every check compares a fast form (a kernel) with an independent form of the same math (a float64
or fp32-HIGHEST reference, another implementation), never with itself, and judges each error
against a limit written beside it. The limits come from one analysis:

- A rounding to a format moves a value by at most u of itself, u the format's unit roundoff
  (`UNIT_ROUNDOFF`: bf16 2^-8 = 3.9e-3, TF32 2^-11 = 4.9e-4, fp32 2^-24 = 6.0e-8). The checks'
  inputs are unit-scale and their outputs O(1), so a rounding anywhere on the path moves the
  output by about u of the output's largest magnitude (a rounded operand of a sum of random-sign
  terms moves it by about u of the sum, sqrt-summed). `rounding_limit(fmt, stages)` is
  stages x u: the error of `stages` successive roundings on the longest path from the inputs to
  the output (each check counts its stages beside the call), measured as max |a - b| / max |b|.
- A sum of K products accumulated in fp32 is off by at most gamma_K = K u / (1 - K u) times the
  sum of the products' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 3.1):
  `accumulation_limit` is that bound, elementwise (the caller gives |A| |B|).

What a real bug does is far outside these: a wrong scale (a head dim's 1/sqrt(d) for another's,
a missing factor) moves the output by > 10 %; a dropped or repeated block (a tile, a chunk, a
document's keys) changes whole rows by O(1); a transposed operand scrambles every element. Each
check's CPU test (tests/test_check_faults.py) seeds such faults and shows the check fails on
them, and passes on the real code.

Output: each verdict is printed as one line,

    PASS <check> <case> <quantity> = <value> <= <limit> (<why>)
    FAIL <check> <case> <quantity> = <value> > <limit> (<why>)

    PASS <check> <case> <quantity> (<why>)                      a yes/no verdict (`expect`)

(a value that is not finite is a FAIL), and kept as a row {"check", "case", "quantity",
"value", "limit", "pass", "why"} (value and limit null for a yes/no verdict);
`Verdicts.exit_code()` is 1 when any failed.
"""

from __future__ import annotations

import math

import numpy as np

UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "tf32": 2.0**-11, "float32": 2.0**-24,
                 "float64": 2.0**-53}


def unit_roundoff(fmt) -> float:
    """u of a format: a dtype or its name, or "tf32" (the tensor cores' fp32 products)."""
    name = fmt if isinstance(fmt, str) else np.dtype(fmt).name
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for {name!r}; known: {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[name]


def rounding_limit(fmt, stages: int) -> float:
    """stages x u(fmt): the largest max |a - b| / max |b| of `stages` roundings to fmt on the
    path from exact inputs to the output (module docstring)."""
    return stages * unit_roundoff(fmt)


def accumulation_limit(abs_products, terms: int, fmt="float32"):
    """gamma_K x (|A| |B|): the largest error of each element of an fp32-accumulated sum of
    `terms` products, given the sums of the products' magnitudes (same shape)."""
    u = unit_roundoff(fmt)
    gamma = terms * u / (1 - terms * u)
    return gamma * np.asarray(abs_products, np.float64)


def max_rel(a, b) -> float:
    """max |a - b| / max |b| in float64; NaN or inf anywhere in a gives inf."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all():
        return math.inf
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def bound_ratio(a, b, bound, floor: float = 0.0) -> float:
    """max over elements of |a - b| / (bound + floor): at most 1 where every element is within
    its own bound; inf where a is not finite."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a).all():
        return math.inf
    return float((np.abs(a - b) / (np.asarray(bound, np.float64) + floor + 1e-300)).max())


class Verdicts:
    """The verdicts of one check: `judge` each quantity against its limit; `rows`, `lines`,
    `exit_code()`."""

    def __init__(self, check: str, out=print):
        self.check, self.out = check, out
        self.rows: list[dict] = []

    def judge(self, case: str, quantity: str, value, limit: float, why: str) -> bool:
        value = float(value)
        ok = bool(math.isfinite(value) and value <= limit)
        row = {"check": self.check, "case": case, "quantity": quantity, "value": value, "limit": float(limit),
               "pass": ok, "why": why}
        self.rows.append(row)
        self.out(line(row))
        return ok

    def expect(self, case: str, quantity: str, ok: bool, why: str) -> bool:
        """A yes/no verdict (tokens that must match, a line that must be printed): no value, no limit."""
        ok = bool(ok)
        row = {"check": self.check, "case": case, "quantity": quantity, "value": None, "limit": None, "pass": ok,
               "why": why}
        self.rows.append(row)
        self.out(line(row))
        return ok

    @property
    def passed(self) -> bool:
        return all(r["pass"] for r in self.rows)

    def failed(self) -> list[dict]:
        return [r for r in self.rows if not r["pass"]]

    def exit_code(self) -> int:
        return 0 if self.passed else 1


def line(row: dict) -> str:
    """The printed form of a verdict row (module docstring)."""
    if row["limit"] is None:
        return f"{'PASS' if row['pass'] else 'FAIL'} {row['check']} {row['case']} {row['quantity']} ({row['why']})"
    op = "<=" if row["pass"] else ">"
    return (f"{'PASS' if row['pass'] else 'FAIL'} {row['check']} {row['case']} {row['quantity']} = "
            f"{row['value']:.3e} {op} {row['limit']:.3e} ({row['why']})")
