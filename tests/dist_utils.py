"""Run a function on N local ranks with torch.distributed (gloo) and collect what each returns."""
import os
import pickle
import time
import traceback

import torch.multiprocessing as mp

from spice_megatron.torchrun import free_port


def _entry(rank, world, port, fn, args, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # report to the parent, which re-raises with the traceback
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    tmp = os.path.join(out_dir, f".rank{rank}.pkl")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pkl"))
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except ValueError:  # already torn down by the code under test
            pass


def run_ranks(fn, world: int, *args, tmp_path, timeout: float = 600):
    """fn(*args) on `world` spawned ranks; returns the per-rank results in rank order."""
    out_dir = str(tmp_path / f"ranks_{free_port()}")
    os.makedirs(out_dir)
    ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, out_dir), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=2):
        errors = [v for status, v in _reported(out_dir, world).values() if status != "ok"]
        if errors or time.monotonic() > deadline:  # the other ranks would wait in a collective
            for p in ctx.processes:
                p.kill()
            raise AssertionError(errors[0] if errors else f"ranks timed out after {timeout}s")
    reported = _reported(out_dir, world)
    for r in range(world):
        if r not in reported:
            raise AssertionError(f"rank {r} exited without a result")
        if reported[r][0] != "ok":
            raise AssertionError(reported[r][1])
    return [reported[r][1] for r in range(world)]


def _reported(out_dir, world):
    out = {}
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.pkl")
        if os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    out[r] = pickle.load(f)
            except (EOFError, pickle.UnpicklingError):  # still being written
                pass
    return out
