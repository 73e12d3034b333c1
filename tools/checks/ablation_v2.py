#!/usr/bin/env python3
"""Ablation v2: does SPICE beat a fixed challenger, Absolute Zero's reward and R-Zero's? One seed
per invocation; the verdict over seeds is tools/checks/ablation_verdict.py's, read into
docs/learning.md from the seeds committed under docs/data/ablation_v2/.

  python tools/checks/ablation_v2.py --seed 1234 [--out runs/ablation_v2] [--sentinel]
  python tools/checks/ablation_v2.py --seed 1234 --arms spice --reasoner-task random   # the pilot

The protocol, fixed before any run (docs/learning.md says it in words):
- Arms: spice; fixed_challenger (the base model, frozen, writes the tasks; only the reasoner
  trains); absolute_zero and r_zero (SPICE with those challenger rewards); ungrounded
  (selfplay.grounding=none) only with --sentinel, on one seed. No lr = 0 controls: a control is the
  base model by construction, measured once per seed (the spice run's iteration 0).
- The self-play check's setting (tiny_cpu, stories, 6 documents x G = 8, lr 1e-5) for 8 iterations,
  evaluations at 4 and 8. The reasoner trains on a random valid task of each document, the paper's
  choice (--reasoner-task frontier: the recipe's, where a pilot shows the paper's does not learn).
- Primary endpoint: greedy accuracy at iteration 8 on the seed's complement set, a question for
  every story arithmetic that no document the seed draws states (story_corpus.complement). The
  draws follow the seed alone (one batch of documents per iteration, the same for every arm), so
  the set is computed here before the runs and written with them.
- Secondary (the challenger): at every evaluation each arm's policy writes G = 8 tasks on 64
  held-out stories; the base model answers them afterwards (learning_runs.challenger_scores).
Each run is kept as OUT/seed_S/ARM.done.json as it finishes (a killed invocation resumes); the
seed's record, docs/data/ablation_v2/seed_S.json, is written when every arm is done: commit it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from learning_runs import ROOT, _finished, _keep, _run, _write_jsonl, challenger_scores, content_hash  # noqa: E402

ARMS = {"spice": [], "fixed_challenger": ["selfplay.challenger=model", "selfplay.challenger_model={model}"],
        "absolute_zero": ["selfplay.challenger_reward=absolute_zero"],
        "r_zero": ["selfplay.challenger_reward=r_zero"], "ungrounded": ["selfplay.grounding=none"]}
DEFAULT_ARMS = ("spice", "fixed_challenger", "absolute_zero", "r_zero")
SETTINGS = {"iterations": 8, "eval_every": 4, "batch": 6, "group": 8, "max_tokens": 24, "challenger_tokens": 80,
            "lr": 1e-5, "staleness": 0, "heldout": 300, "challenger_docs": 64}
RECORD_DIR = os.path.join(ROOT, "docs", "data", "ablation_v2")
KEPT_METRICS = ("valid_task_rate", "reasoner/pass_rate", "reasoner/nonzero_advantage_rate",
                "challenger/nonzero_advantage_rate", "challenger/task_reward_mean", "challenger/frontier_share",
                "train/loss")


def drawn_stories(stories_file: str, seed: int, iterations: int, batch: int) -> list[list[int]]:
    """Per iteration, the record indices of the stories a run with this seed trains on: the
    trainer's own corpus and sampler (driver.py), which draw one batch an iteration whatever the arm."""
    from recipes import get_recipe
    from spice_megatron.config import SourceConfig
    from spice_megatron.data.corpus import Corpus, DocumentSampler, load_tokenizer
    from spice_megatron.data.offline_assets import smollm2_dir

    cfg = get_recipe("tiny_cpu")
    cfg.corpus.sources = [SourceConfig(path=stories_file)]
    sampler = DocumentSampler(Corpus.build(cfg.corpus, load_tokenizer(smollm2_dir()), "tiny_cpu"), seed)
    return [[d.record_index for d in sampler.next_batch(batch)] for _ in range(iterations)]


def prepare_seed(out: str, seed: int) -> dict:
    """The seed's stories, its draws, its complement set and the held-out stories the challenger
    writes on, as files under `out`."""
    from spice_megatron.data import story_corpus

    stories = story_corpus.make_stories(2000, n_heldout=SETTINGS["heldout"])
    train_file = _write_jsonl(os.path.join(out, "stories.jsonl"), story_corpus.corpus_rows(stories))
    draws = drawn_stories(train_file, seed, SETTINGS["iterations"], SETTINGS["batch"])
    drawn = {(stories[i].kind, stories[i].a, stories[i].b) for batch in draws for i in batch}
    items = story_corpus.eval_rows(story_corpus.complement(drawn))
    heldout = f"file:{_write_jsonl(os.path.join(out, 'complement.jsonl'), items)}:math"
    docs = [{"doc_id": f"heldout/{i}/0", "text": st.text, "answer": str(st.answer)}
            for i, st in enumerate(story_corpus.make_heldout(SETTINGS["heldout"])[:SETTINGS["challenger_docs"]])]
    return {"train_file": train_file, "heldout": heldout, "draws": draws, "complement_items": len(items),
            "challenger_docs_file": _write_jsonl(os.path.join(out, "challenger_docs.jsonl"), docs),
            "gold": {d["doc_id"]: d["answer"] for d in docs}}


def kept_run(run_dir: str, run: dict) -> dict:
    """What the verdict and a later analysis read of a finished run: per-item correctness at each
    evaluation, the metrics the analysis lacked before (per iteration) and the documents drawn."""
    import glob

    from spice_megatron.eval.run import evaluation_records
    from spice_megatron.run.log import read_jsonl

    evaluations = {it: {r["id"]: bool(r["correct"]) for r in records}
                   for it, records in evaluation_records(os.path.join(run_dir, "eval")).items()}
    drawn = sorted({(r["iteration"], r["doc_id"]) for r in read_jsonl(os.path.join(run_dir, "audit.jsonl"))
                    if r.get("kind") == "document"})
    written = sorted(glob.glob(os.path.join(run_dir, "challenger_eval", "iteration_*.json")))
    with open(written[-1]) as f:  # the last evaluation's tasks: what the challenger's comparison scores
        last_tasks = json.load(f)
    return {"seconds": run["seconds"], "evaluations": evaluations, "drawn": drawn,
            "kept": {"challenger_tasks": last_tasks},
            "metrics": [{k: m.get(k) for k in ("iteration", *KEPT_METRICS)} for m in run["metrics"]]}


def main() -> int:
    from spice_megatron.data.offline_assets import smollm2_dir
    from spice_megatron.entry import UserError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True, help="the seed of every run (run.seed, train.seed)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "ablation_v2"), help="where the runs go")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of: {', '.join(ARMS)}")
    ap.add_argument("--sentinel", action="store_true", help="add the ungrounded arm (one seed of the protocol)")
    ap.add_argument("--reasoner-task", choices=["random", "frontier"], default="random",
                    help="selfplay.reasoner_task (the paper's: random)")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a] + (["ungrounded"] if args.sentinel else [])
    if "spice" not in arms or any(a not in ARMS for a in arms):
        raise UserError(f"--arms {args.arms}: of {', '.join(ARMS)}, spice (the reference and the base figures) "
                        "among them")
    model = smollm2_dir()
    out = os.path.join(args.out, f"seed_{args.seed}")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    seed_data = prepare_seed(out, args.seed)
    from spice_megatron.data.story_corpus import PROMPT_DIR, REASONER_STOP

    run_args = argparse.Namespace(
        model=model, selfplay=True, challenger_docs_file=seed_data["challenger_docs_file"], out=out,
        seeds=[args.seed], prompt_dir=PROMPT_DIR, stop=REASONER_STOP, **SETTINGS)
    from spice_megatron.rollout.step_settings import CPU_BLOCK_TOKENS

    # the engines' KV block is in the key: a run at vLLM's 128 (the pilot) is not paired with runs at 32
    settings = {**SETTINGS, "seed": args.seed, "reasoner_task": args.reasoner_task, "kv_block": CPU_BLOCK_TOKENS,
                "content": content_hash([os.path.join(ROOT, "recipes", "tiny_cpu.py"), seed_data["train_file"],
                                         seed_data["heldout"].split(":")[1], PROMPT_DIR])}
    print(f"seed {args.seed}: complement set of {seed_data['complement_items']} questions; arms {', '.join(arms)}",
          flush=True)
    runs = {}
    for arm in arms:
        arm_settings = {**settings, "arm": ARMS[arm]}
        kept = _finished(out, arm, arm_settings)
        if kept is None:
            run_args.extra = [o.format(model=model) for o in ARMS[arm]] + [
                f"selfplay.reasoner_task={args.reasoner_task}", f"run.eval_before={str(arm == 'spice').lower()}"]
            run = _run(arm, out, seed_data["train_file"], seed_data["heldout"], run_args, args.seed, SETTINGS["lr"])
            kept = _keep(out, arm, arm_settings, kept_run(os.path.join(out, arm), run))
        kept["evaluations"] = {int(it): items for it, items in kept["evaluations"].items()}  # JSON keys: strings
        runs[arm] = {**kept, "seed": args.seed}
        spice_items = runs["spice"]["evaluations"]
        print(f"seed {args.seed} {arm}: held-out {_accuracy(kept['evaluations'])} ({kept['seconds'] / 60:.1f} min); "
              f"base {_accuracy({0: spice_items[0]})}", flush=True)
    if not set(DEFAULT_ARMS) <= set(arms):  # a pilot: its runs are kept for the seed, no record is written
        print(f"seed {args.seed}: {', '.join(arms)} done (a pilot: the seed's record needs every arm of "
              f"{', '.join(DEFAULT_ARMS)})", flush=True)
        return 0
    run_args.extra = [f"selfplay.reasoner_task={args.reasoner_task}"]  # the scoring reads the recipe's rewards
    key = {**settings, "arms": arms}
    scores = _finished(out, "challenger_scores", key) or _keep(
        out, "challenger_scores", key, challenger_scores(run_args, runs, seed_data["gold"], last_only=True))
    record = {"protocol": "ablation v2", "seed": args.seed, "settings": settings, "draws": seed_data["draws"],
              "complement_items": seed_data["complement_items"], "minutes": (time.perf_counter() - t0) / 60,
              "runs": runs, "challenger": {arm: {it: docs for it, docs in s.items()} for arm, s in scores.items()}}
    os.makedirs(RECORD_DIR, exist_ok=True)
    path = os.path.join(RECORD_DIR, f"seed_{args.seed}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, sort_keys=True)
    os.replace(path + ".tmp", path)
    print(f"ablation v2 seed {args.seed}: done in {record['minutes']:.1f} min; record {os.path.relpath(path, ROOT)} "
          "(commit it; python tools/docs_tables.py lays out the verdict)", flush=True)
    return 0


def _accuracy(evaluations: dict) -> str:
    return ", ".join(f"{100 * sum(items.values()) / len(items):.1f}% at {it}"
                     for it, items in sorted(evaluations.items(), key=lambda x: int(x[0])))


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
