"""Process groups: the driver's control group outlives NCCL-style default timeouts, within its bound."""
import os
import time

import pytest
from dist_utils import run_ranks


def _control_rank(wait_s):
    from datetime import timedelta

    import torch.distributed as dist

    from spice_megatron.policy.parallel import any_rank as _any_rank
    from spice_megatron.policy.parallel import broadcast_from_driver as _broadcast
    from spice_megatron.policy.parallel import control_group

    # the default group stands for NCCL with its watchdog: a short timeout. The ranks meet through a store
    # that waits for both however slowly a loaded machine starts them (its own 2 s once failed CI there).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2, int(os.environ["RANK"]) == 0,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=2,
                            timeout=timedelta(seconds=2))
    long_wait = control_group(timeout_s=60)
    short_wait = control_group(timeout_s=2)
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(wait_s)  # the driver alone runs rollouts longer than the default group's timeout
    got = _broadcast({"batch": [1, 2, 3]} if rank == 0 else None, long_wait)
    flag = _any_rank(rank == 1, long_wait)
    if rank == 0:
        time.sleep(wait_s)
    try:
        _broadcast("late" if rank == 0 else None, short_wait)
        bounded = "no timeout"
    except Exception as e:  # noqa: BLE001 - gloo reports the timeout as a RuntimeError
        bounded = type(e).__name__
    return got, flag, bounded


@pytest.mark.multiprocess
def test_driver_messages_wait_past_the_default_timeout_and_within_their_bound(tmp_path):
    (got0, flag0, _), (got1, flag1, bounded1) = run_ranks(_control_rank, 2, 5.0, tmp_path=tmp_path, timeout=120)
    assert got0 == got1 == {"batch": [1, 2, 3]} and flag0 is flag1 is True
    assert bounded1 != "no timeout"  # the receiving rank gave up after the control group's 2 s


def test_stop_file_requests_a_stop(tmp_path):
    from spice_megatron.run.control import StopRequest

    stop = tmp_path / "STOP"
    request = StopRequest(str(stop))
    try:
        assert not request.requested
        stop.touch()  # what slurm/spice_job.sh does when the time limit is near
        assert request.requested
    finally:
        request.restore()
