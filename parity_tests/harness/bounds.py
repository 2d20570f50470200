"""The suite's numerical bounds, and how close each test comes to its own.

A bound is `c * UNIT_ROUNDOFF[dtype] * scale`: the unit roundoff u of the coarsest dtype the compared
values went through (one rounding moves a value by at most u of itself; two computations that round
the same value differently are at most one ulp = 2u apart), the scale the difference is measured
against (a reference's largest entry, or the sum of magnitudes a reordered sum adds up), and c the
rounding steps that can differ between the two sides, as each test's comment states them. Integer-
valued inputs make most transport results exact; there the suite compares with torch.equal instead.

With CP_TEST_MARGINS=1 the suite prints each test's worst ratio of difference to bound at the end
(parity_tests/conftest.py): a ratio within 0.1 of 1 is a bound that sits within 10x of what a CPU
gave, and its comment must say why that is the arithmetic and not luck.
"""

import os

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
ENV_VAR = "CP_TEST_MARGINS"
WORST = {}  # test id -> (ratio, what, difference, bound): the closest comparison of each test


def u(dtype):
    """The unit roundoff of a dtype (or of its name, "float32")."""
    return UNIT_ROUNDOFF[getattr(torch, dtype) if isinstance(dtype, str) else dtype]


def check(difference, bound, what):
    """Assert `difference <= bound` (NaN fails) and keep the ratio for the margins report."""
    difference, bound = (
        float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for v in (difference, bound)
    )
    ratio = difference / bound if bound > 0 else (0.0 if difference == 0 else float("inf"))
    if ratio != ratio:  # NaN
        ratio = float("inf")
    test = os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" (", 1)[0]
    if ratio >= WORST.get(test, (-1.0,))[0]:
        WORST[test] = (ratio, what, difference, bound)
    assert difference <= bound, f"{what}: {difference:.3e} over its bound {bound:.3e}"


def report():
    """Lines of the margins report: every recorded test, closest to its bound first."""
    lines = [f"worst difference / bound per test ({len(WORST)} tests; over 0.1: within 10x)"]
    for test, (ratio, what, difference, bound) in sorted(WORST.items(), key=lambda kv: -kv[1][0]):
        flag = "  <-- within 10x" if ratio > 0.1 else ""
        lines.append(f"{ratio:9.2e}  {difference:.2e} / {bound:.2e}  {test}: {what}{flag}")
    return lines
