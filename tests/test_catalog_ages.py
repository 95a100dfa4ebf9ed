"""How `iop catalog` says a time left or an age: in a unit a person reads at a glance."""

from __future__ import annotations

import pytest

from iop.catalog_cmd import _age


@pytest.mark.parametrize(("ms", "shown"), [
    (None, "-"), (0, "0ms"), (999, "999ms"), (1500, "1.5s"), (119_999, "120.0s"),
    (120_000, "2m"), (90 * 60_000, "90m"), (119 * 60_000, "119m"),
    (2 * 3_600_000, "2h"), (30 * 3_600_000, "30h"),
    (48 * 3_600_000, "2d"), (7 * 86_400_000 - 1_000, "7d"),
])
def test_an_age_is_said_in_a_unit_that_fits_it(ms: int | None, shown: str) -> None:
    assert _age(ms) == shown
