"""The session-end check (conftest.py) finds a process by the suite's marker and names its test."""
import os
import subprocess
import sys

import pytest
from leftovers import SUITE_MARKER, alive, kill, marked_processes


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_marked_process_is_found_and_named_by_its_test():
    env = {**os.environ, SUITE_MARKER: "probe-123", "PYTEST_CURRENT_TEST": "tests/x.py::test_y (call)"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        # Until the child has exec'd, /proc shows the parent's environment (no marker): wait for its line.
        assert proc.stdout.readline().strip() == "up"
        found = marked_processes("probe-123", exclude={os.getpid()})
        assert list(found) == [proc.pid]
        assert found[proc.pid].startswith("tests/x.py::test_y (call): ") and "time.sleep(60)" in found[proc.pid]
        assert marked_processes("probe-123", exclude={os.getpid(), proc.pid}) == {}
    finally:
        kill([proc.pid])
        proc.wait(10)
    assert marked_processes("probe-123", exclude={os.getpid()}) == {}


SAVING_RANK = """
import sys, time
from spice_megatron.bridge.convert import convert_from_hf

if __name__ == "__main__":
    convert_from_hf(sys.argv[1], sys.argv[2], 1, 1)  # one rank: a checkpoint save through megatron's writer
    print("saved", flush=True)
    time.sleep(600)
"""


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                children = {int(c) for c in f.read().split()}
        except OSError:
            continue
        found |= children
        todo += list(children)
    return found


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_rank_killed_after_a_checkpoint_save_leaves_no_process(tmp_path):
    """megatron's checkpoint writer spawns a Manager server at the first save; kill -9 of the rank
    must take it (and every other helper) along."""
    import time

    from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config

    model = make_tiny_hf_model(str(tmp_path / "model"), tiny_hf_config("qwen3"))
    script = tmp_path / "rank.py"
    script.write_text(SAVING_RANK)
    proc = subprocess.Popen([sys.executable, str(script), model, str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "MASTER_PORT": str(_free_port())})
    try:
        assert proc.stdout.readline().strip() == "saved"
        helpers = _descendants(proc.pid)
        assert helpers, "the save started no helper process: nothing to check"
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 20
    while any(alive(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in helpers if alive(p)]
    kill(left)
    assert not left, f"helpers outlived their killed rank: {left}"


def _free_port() -> int:
    from spice_megatron.torchrun import free_port

    return free_port()
