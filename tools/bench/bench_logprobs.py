#!/usr/bin/env python3
"""Peak memory and time of the log-prob + DrGRPO loss step at the Qwen3 vocabulary (151,936) with
TP=2: vocab-parallel log-probs (what the learner does) versus gathering full-vocabulary logits.

Each variant runs in its own pair of fresh processes (gloo on CPU, NCCL on GPU) so that the
peak-memory high-water marks do not mix. Prints both and their ratios.

  python tools/bench/bench_logprobs.py [--tokens 1024] [--hidden 512] [--repeats 3]
"""
from __future__ import annotations

import os
import resource
import sys
import time

import torch
import torch.multiprocessing as mp

VOCAB = 151_936


def _peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rank(rank: int, world: int, port: int, variant: str, tokens: int, hidden: int, repeats: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from spice_megatron.config import ParallelConfig
    from spice_megatron.policy.logprobs import token_logprobs
    from spice_megatron.policy.parallel import init_distributed
    from spice_megatron.selfplay.loss import drgrpo_token_loss

    init_distributed(ParallelConfig(tensor_parallel=world))
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, tokens, hidden, generator=g) * 0.1).to(dev)
    w = (torch.randn(VOCAB // world, hidden, generator=torch.Generator().manual_seed(rank)) * 0.02).to(dev)
    w.requires_grad_(True)
    labels = torch.randint(0, VOCAB, (1, tokens), generator=g).to(dev)
    mask = torch.ones(1, tokens, device=dev)
    adv = torch.ones(1, device=dev)

    def step() -> float:
        logits = (h @ w.T)  # [1, tokens, V/TP]: this rank's vocabulary shard
        if variant == "vocab_parallel":
            lp = token_logprobs(logits, labels)
        else:  # the naive way: every rank materialises full-vocabulary logits
            full = gather_from_tensor_model_parallel_region(logits)
            lp = torch.log_softmax(full.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss, _ = drgrpo_token_loss(lp, adv, mask, max_gen_len=tokens)
        loss.backward()
        w.grad = None
        return lp.detach().sum().item()

    base = _peak_bytes()  # inputs and weights allocated, nothing computed yet
    step()  # warm-up
    torch.distributed.barrier()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out.put((rank, variant, min(times), _peak_bytes(), base, loss))
    torch.distributed.destroy_process_group()


def run_variant(variant: str, args) -> dict:
    from spice_megatron.torchrun import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, variant, args.tokens, args.hidden, args.repeats, q))
             for r in range(2)]
    for p in procs:
        p.start()
    rows = [q.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return {"seconds": max(r[2] for r in rows), "peak_bytes": max(r[3] - r[4] for r in rows), "logprob_sum": rows[0][5]}


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, default=1024)
    ap.add_argument("--hidden", type=positive_int, default=512)
    ap.add_argument("--repeats", type=positive_int, default=3)
    args = ap.parse_args()
    print(f"vocab {VOCAB}, TP=2, {args.tokens} tokens, hidden {args.hidden}, "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    res = {v: run_variant(v, args) for v in ("vocab_parallel", "gather_full_logits")}
    for v, r in res.items():
        print(f"  {v:20s} {r['seconds'] * 1e3:9.1f} ms   peak {r['peak_bytes'] / 2**20:9.1f} MiB per rank "
              f"above inputs   sum of log-probs {r['logprob_sum']:.4f}")
    vp, gf = res["vocab_parallel"], res["gather_full_logits"]
    print(f"peak memory ratio (gather / vocab-parallel): {gf['peak_bytes'] / vp['peak_bytes']:.2f}x")
    print(f"time ratio (gather / vocab-parallel):        {gf['seconds'] / vp['seconds']:.2f}x")
    if abs(vp["logprob_sum"] - gf["logprob_sum"]) > 1e-3 * abs(gf["logprob_sum"]):
        print("ERROR: the two variants disagree on the log-probs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
