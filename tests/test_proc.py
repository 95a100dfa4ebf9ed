"""iop.proc: waiting for a line of a real `iop` child process."""

from __future__ import annotations

import os

import pytest

from iop.proc import IopProcess, NotReady
from tests.conftest import ROOT


@pytest.mark.parametrize("keep_lines", [None, 1])
def test_a_printed_line_is_found_even_after_the_process_ended(keep_lines: int | None) -> None:
    proc = IopProcess("validate", ["config", "validate", "examples/demo.yaml"], dict(os.environ), cwd=ROOT,
                      keep_lines=keep_lines)
    assert proc.wait_for_line(r"^OK: (\d+) models").group(1) == "2"
    assert proc.popen.wait(timeout=20) == 0
    assert proc.stop() == 0  # already ended: nothing to signal
    with pytest.raises(NotReady, match="no line matching"):
        proc.wait_for_line("never printed", timeout=5)
