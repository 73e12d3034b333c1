#!/usr/bin/env python3
"""How well does the base model follow a challenger few-shot file on the story documents? Before any
training, with plain vLLM (in-process, CPU): per prompt file, the valid tasks (leak_check=all, as
the tiny_cpu recipe), those whose gold is the story's result, and those invalid for leaking it.

  python tools/checks/probe_story_prompt.py [PROMPT_FILE ...] [--docs 16] [--samples 8] [--temperature 0.5]

Default: the recipe's file (spice_megatron/prompts/stories/challenger_compact.txt). Generation stops
at the file's last example tag, as in training (protocol.compact_stop). Measured 2026-12-02
(16 x 8 at 0.5): question first 99/128 valid, 37 with the right gold; answer first 98/128, 97.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    from spice_megatron.data.story_corpus import PROMPT_DIR, make_stories
    from spice_megatron.selfplay.protocol import compact_stop
    from spice_megatron.tasks import answer_in_question, parse_challenger_output

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", nargs="*", default=[os.path.join(PROMPT_DIR, "challenger_compact.txt")])
    ap.add_argument("--model", default="", help="HF directory (default: SmolLM2-135M-Instruct from its wheel)")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=80)
    args = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from spice_megatron.data.offline_assets import smollm2_dir

    # the engine settings the project's CPU engines use (seeded sampling needs chunked prefill off)
    llm = LLM(model=args.model or smollm2_dir(), dtype="float32", enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=2**30, seed=0, enable_chunked_prefill=False, max_num_batched_tokens=8192)
    docs = random.Random(0).sample(make_stories(2000, n_heldout=300), args.docs)
    for path in args.prompts:
        with open(path) as f:
            template = f.read()
        stop = compact_stop(template)
        params = [SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens,
                                 seed=100 + i, stop=[stop], include_stop_str_in_output=True) for i in range(len(docs))]
        results = llm.generate([template.replace("{document}", d.text) for d in docs], params, use_tqdm=False)
        valid = right = leaks = 0
        for doc, result in zip(docs, results):
            for out in result.outputs:
                parsed = parse_challenger_output(out.text, "all")
                if parsed.valid:
                    valid += 1
                    right += parsed.task.answer.strip() == str(doc.answer)
                else:
                    loose = parse_challenger_output(out.text, "long")
                    leaks += loose.valid and answer_in_question(loose.task)
        total = len(docs) * args.samples
        print(f"{path}: stop {stop!r}: valid {valid}/{total}, gold = the story's result {right}, "
              f"invalid for leaking it {leaks}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
