"""The learning checks' pieces (tools/checks/learning_check.py runs them, tools/checks/learning_ablation.py too):
tasks, `spice train` runs kept by their settings' hash, held-out scoring, intervals and the
challenger's verdict. A module of its own so that the two commands import it, not each other."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from spice_megatron.eval.stats import wilson  # noqa: E402,F401 - the checks' intervals, also as learning_runs.wilson

GAIN_POINTS = 10.0
CHALLENGER_CURVES = {"valid_task_rate": "valid_task_rate", "challenger_reward": "challenger/task_reward_mean",
                     "frontier_share": "challenger/frontier_share", "leak_rate": "challenger/leak_rate",
                     "pass_rate": "reasoner/pass_rate"}


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
           "--output", run_dir, "--eval-benchmarks", heldout, "--data", out, *challenger_eval,
           *_mode_args(args, train_file), *_selfplay_overrides(args),
           "train.micro_batch_tokens=2048",
           f"optim.lr={lr}", "optim.weight_decay=0.0", "optim.clip_grad=1.0", f"train.max_staleness={args.staleness}",
           f"run.iterations={args.iterations}", f"run.seed={seed}", f"train.seed={seed}",
           f"run.eval_every={args.eval_every}", f"run.checkpoint_every={args.iterations}", "run.export_hf=false",
           "rollout.max_model_len=1024", "rollout.kv_cache_gib=1.0", "run.min_valid_task_rate=0.0", *args.extra]
    if os.path.isdir(run_dir):  # an earlier invocation's unfinished run (a finished one is kept as .done.json)
        print(f"{name}: an unfinished earlier run in {run_dir}: started again", flush=True)
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        rc = run_to_end(cmd, log)
    if rc != 0:
        raise RuntimeError(f"run {name} failed with exit code {rc}; see {out}/{name}.log")
    from spice_megatron.metric_names import current_names

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [current_names(json.loads(line)) for line in f]
    metrics = [m for m in metrics if m["iteration"] > 0]  # the run's own base-model evaluation: the baseline has it
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
    acc = [(0, before["accuracy"])] + [(m["iteration"], m[key]) for m in run["metrics"] if m.get(key) is not None]
    return {
        "reward": [m.get("reasoner/reward_mean", float("nan")) for m in run["metrics"]],
        "boxed_rate": [1.0 - m.get("reasoner/no_boxed_rate", float("nan")) for m in run["metrics"]],
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
    from spice_megatron.run.audit import with_document_texts
    from spice_megatron.run.log import read_jsonl

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
    from spice_megatron.selfplay.verify import AnswerVerifier

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
    """The trained runs' held-out variance reward and frontier share at their last evaluation
    against the base model's (iteration 0: the same stories, the same sampling seeds, which is
    what a frozen control writes), paired per story. Learned when the variance reward's gain,
    pooled over every seed's stories, has a bootstrap 95% interval above 0: a per-seed AND of 32
    stories each would pass less often the more seeds it is given. Per-seed figures are reported."""
    from spice_megatron.eval.challenger_eval import paired_bootstrap

    per_seed, parts, pooled = {}, [], {"variance_reward": ([], []), "frontier_share": ([], [])}
    for name in runs:
        if not name.startswith("trained") or name not in scores or 0 not in scores[name] or max(scores[name]) == 0:
            continue
        last = max(scores[name])
        t, b = scores[name][last], scores[name][0]
        if [d["doc_id"] for d in t] != [d["doc_id"] for d in b]:
            raise ValueError(f"{name}: its evaluations were on other documents")
        result = {"iteration": last}
        for metric, (after, before) in pooled.items():
            result[metric] = paired_bootstrap([d[metric] for d in t], [d[metric] for d in b], seed=runs[name]["seed"])
            after += [d[metric] for d in t]
            before += [d[metric] for d in b]
        per_seed[name] = result
        parts.append(f"{name} (seed {runs[name]['seed']}, iteration {last}) variance reward "
                     f"{_mean_of(b, 'variance_reward'):.3f} -> {_mean_of(t, 'variance_reward'):.3f}: "
                     + ", ".join(f"{m.replace('_', ' ')} {d:+.3f} (95% CI {lo:+.3f} to {hi:+.3f})"
                                 for m, (d, lo, hi) in ((m, result[m]) for m in pooled)))
    if not per_seed:
        return {"learned": False, "per_seed": {}, "pooled": {}, "line": "no trained run with a held-out evaluation"}
    first_seed = min(runs[n]["seed"] for n in per_seed)
    together = {m: paired_bootstrap(a, b, seed=first_seed) for m, (a, b) in pooled.items()}
    learned = together["variance_reward"][1] > 0
    stories = len(pooled["variance_reward"][0])
    line = (f"pooled over {len(per_seed)} seed(s), {stories} stories: variance reward "
            f"{together['variance_reward'][0]:+.3f} (95% CI {together['variance_reward'][1]:+.3f} to "
            f"{together['variance_reward'][2]:+.3f}), frontier share {together['frontier_share'][0]:+.3f} (95% CI "
            f"{together['frontier_share'][1]:+.3f} to {together['frontier_share'][2]:+.3f}): "
            f"{'learned' if learned else 'not shown'}; " + "; ".join(parts))
    return {"learned": learned, "per_seed": per_seed, "pooled": together, "line": line}


def _mean_of(scored: list[dict], metric: str) -> float:
    values = [d[metric] for d in scored if d[metric] == d[metric]]
    return sum(values) / len(values) if values else float("nan")
