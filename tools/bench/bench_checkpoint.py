#!/usr/bin/env python3
"""The distributed optimizer's checkpoint saves at DP=2 (gloo, CPU): `dp_reshardable` (each DP
rank writes its own shard of the optimizer state, no exchange) against `fully_reshardable` (the
state gathered per model-parallel group so that any layout can load it), side by side in one run,
each in fresh processes: seconds per save, the host memory each rank's resident set grows by
during the save (sampled every 5 ms), bytes on disk.

On CPU megatron-core 0.16.1 runs the distributed optimizer on its torch fallback, whose *restore*
is broken (the learner refuses it, docs/architecture.md): this benchmark measures saves only and turns the
refusal off for itself (`learner.ALLOW_TORCH_DISTRIBUTED_OPTIMIZER`).

  python tools/bench/bench_checkpoint.py [--hidden 1024] [--layers 6] [--vocab 16384]
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

FORMS = ("dp_reshardable", "fully_reshardable")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank(rank: int, port: int, model_dir: str, form: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.policy import learner as learner_module
    from spice_megatron.policy.batching import TrainSequence
    from spice_megatron.policy.checkpoint import save_checkpoint

    learner_module.ALLOW_TORCH_DISTRIBUTED_OPTIMIZER = True
    learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(
        lr=1e-5, use_distributed_optimizer=True, checkpoint_sharding=form), PolicyTrainConfig(max_gen_len=8))
    learner.train_on_batch([TrainSequence([1, 2, 3], [4, 5], 0.5), TrainSequence([1, 2], [3, 4, 5], -0.5)])
    peak, before, done = [0], _rss(), threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    dist.barrier()
    sampler.start()
    t0 = time.perf_counter()
    path = save_checkpoint(learner, os.path.join(out, form), step=1)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    result = {"seconds": seconds, "grew": peak[0] - before,
              "params": sum(p.numel() for p in learner.model.parameters())}
    if rank == 0:
        result["disk"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    with open(os.path.join(out, f"{form}.{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=positive_int, default=1024)
    ap.add_argument("--layers", type=positive_int, default=6)
    ap.add_argument("--vocab", type=positive_int, default=16384)
    ap.add_argument("--repeats", type=positive_int, default=2)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config
    from spice_megatron.torchrun import free_port

    work = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        heads = args.hidden // 64
        model = make_tiny_hf_model(os.path.join(work, "model"), tiny_hf_config(
            "qwen3", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
            num_kv_heads=max(1, heads // 4), head_dim=64, intermediate_size=3 * args.hidden), seed=1)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for form in FORMS:  # alternating, each in fresh processes
                out = os.path.join(work, "out")
                shutil.rmtree(out, ignore_errors=True)
                os.makedirs(out)
                mp.spawn(_rank, args=(free_port(), model, form, out), nprocs=2)
                ranks = [json.load(open(os.path.join(out, f"{form}.{r}.json"))) for r in range(2)]
                r = {"seconds": max(x["seconds"] for x in ranks), "grew": max(x["grew"] for x in ranks),
                     "disk": ranks[0]["disk"], "params": ranks[0]["params"]}
                if form not in best or r["seconds"] < best[form]["seconds"]:
                    best[form] = r
        dp, full = best["dp_reshardable"], best["fully_reshardable"]
        print(f"{dp['params'] / 1e6:.0f}M parameters (fp32 main weights + Adam: {12 * dp['params'] / 2**30:.2f} GiB), "
              f"DP=2 on {os.cpu_count()} cores, best of {args.repeats}")
        for form, r in best.items():
            print(f"  {form:18s} save {r['seconds']:6.2f} s   host memory grew {r['grew'] / 2**30:5.2f} GiB per rank   "
                  f"{r['disk'] / 2**30:5.2f} GiB on disk")
        print(f"  dp_reshardable / fully_reshardable: time {dp['seconds'] / full['seconds']:.2f}x, "
              f"memory growth {dp['grew'] / max(full['grew'], 1):.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
