"""The session-end check (conftest.py) finds a process by the suite's marker and names its test."""
import os
import subprocess
import sys

import pytest

from leftovers import SUITE_MARKER, kill, marked_processes


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_marked_process_is_found_and_named_by_its_test():
    env = {**os.environ, SUITE_MARKER: "probe-123", "PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        found = marked_processes("probe-123", exclude={os.getpid()})
        assert list(found) == [proc.pid]
        assert found[proc.pid].startswith("tests/x.py::test_y (call): ") and "time.sleep(60)" in found[proc.pid]
        assert marked_processes("probe-123", exclude={os.getpid(), proc.pid}) == {}
    finally:
        kill([proc.pid])
        proc.wait(10)
    assert marked_processes("probe-123", exclude={os.getpid()}) == {}
