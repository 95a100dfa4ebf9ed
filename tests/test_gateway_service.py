"""gateway.service: the connection limits are fitted to the open-file limit."""

from __future__ import annotations

import pytest

from gateway.admission import TRIAGE_SLOTS
from gateway.service import RESERVED_FDS, fit_to_file_limit


@pytest.mark.parametrize(("clients", "pooled", "file_limit", "expected"), [
    (4096, 4096, 20_000, (4096, 4096)),  # fits: unchanged
    (4096, 4096, 4096 * 2 + RESERVED_FDS + TRIAGE_SLOTS, (4096, 4096)),  # exactly fits
    (4096, 4096, 1024, (448, 448)),  # lowered in proportion
    (3000, 1000, 1024, (672, 224)),
    (10, 10, 16, (1, 2)),  # never below one client connection and a pool of two
])
def test_limits_fit_the_file_limit(clients: int, pooled: int, file_limit: int, expected: tuple[int, int]) -> None:
    fitted = fit_to_file_limit(clients, pooled, file_limit)
    assert fitted == expected
    if file_limit > RESERVED_FDS + TRIAGE_SLOTS + 3:
        assert sum(fitted) + RESERVED_FDS + TRIAGE_SLOTS <= file_limit
