#!/usr/bin/env python3
"""One CUDA IPC hand-over as the colocated weight sync makes it, in fresh processes (the caching
allocator reads PYTORCH_CUDA_ALLOC_CONF at CUDA's first allocation): a learner process exports a
staging buffer with torch's reduce_tensor (vLLM's packed IPC producer does) and a sibling process,
as an engine is (never an ancestor of the learner), opens it with rebuild_cuda_tensor and checks it.
Needs only torch; run by tools/checks/gpu_check_colocation.py, as root and as an unprivileged user.

  python ipc_leg.py OUT.json      writes {"ok", "open_ms", "expandable", "error"}
"""
import json
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

MIB = 64


def learner(handles, done) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    buf = torch.arange(MIB * 2**20 // 4, dtype=torch.float32, device="cuda")
    segments = [s for s in torch.cuda.memory_snapshot() if s["total_size"] >= buf.numel() * 4]
    torch.cuda.synchronize()
    handles.put((reduce_tensor(buf), bool(segments and segments[0].get("is_expandable", False))))
    done.wait(120)  # the buffer stays alive until the engine has read it


def engine(handles, results) -> None:
    try:
        (rebuild, args), expandable = handles.get(timeout=120)
        t0 = time.perf_counter()
        got = rebuild(*args)
        total = got.double().sum().item()
        torch.cuda.synchronize()
        n = MIB * 2**20 // 4
        results.put({"ok": total == n * (n - 1) / 2, "open_ms": (time.perf_counter() - t0) * 1e3,
                     "expandable": expandable})
    except Exception as e:  # noqa: BLE001 - reported as the leg's result
        results.put({"ok": False, "error": f"{type(e).__name__}: {e}"[:300],
                     "trace": traceback.format_exc(limit=2)[-300:]})


def main() -> int:
    ctx = mp.get_context("spawn")
    handles, results, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=learner, args=(handles, done)), ctx.Process(target=engine, args=(handles, results))]
    for p in procs:
        p.start()
    try:
        result = results.get(timeout=170)
    except Exception as e:  # noqa: BLE001
        result = {"ok": False, "error": f"no result: {type(e).__name__}"}
    done.set()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    json.dump(result, open(sys.argv[1], "w"))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
