"""The paper's comparisons at laptop scale: `tools/checks/learning_check.py --ablation`.

Arms, each on the same seeds, story documents, iterations and held-out sets as the self-play check
(`--selfplay`), one run per arm and seed (kept as <out>/<arm>_<seed>.done.json, so an interrupted
invocation resumes; the file holds what the comparisons read, the last evaluation's per-item records
and held-out challenger tasks, so the .done.json files alone, copied into another --out, resume the
ablation on another machine or checkout):
  spice             SPICE: the policy writes tasks from documents and answers them; both roles train
  fixed_challenger  the base model, frozen, writes the tasks on the same documents; only the reasoner
                    trains (the paper's strong-challenger baseline, at the same model size here)
  ungrounded        self-play without documents (selfplay.grounding=none: the corpus ablation)
  absolute_zero, r_zero, threshold   SPICE with another challenger reward (the reward ablation)

Per arm and seed: held-out reasoner accuracy at the last evaluation (Wilson 95% interval), its
paired difference to `spice` on the same held-out items (paired bootstrap 95% interval, in points),
and, where the arm trains the challenger, the held-out challenger figures at the last evaluation
(the fixed base model answers the tasks written on fixed held-out stories; paired over the
stories against `spice`). Verdict per arm, pooled over seeds (items of every seed paired with
`spice`'s of the same seed): "SPICE better" when the interval of (arm - spice) lies below 0,
"arm better" above, else "no measurable difference".
"""
from __future__ import annotations

import glob
import json
import os

ARMS: dict[str, list[str]] = {
    "spice": [],
    "fixed_challenger": ["selfplay.challenger=model", "selfplay.challenger_model={model}"],
    "ungrounded": ["selfplay.grounding=none"],
    "absolute_zero": ["selfplay.challenger_reward=absolute_zero"],
    "r_zero": ["selfplay.challenger_reward=r_zero"],
    "threshold": ["selfplay.challenger_reward=threshold"],
}
DEFAULT_ARMS = ("spice", "fixed_challenger", "ungrounded", "absolute_zero", "r_zero")
TRAINS_CHALLENGER = ("spice", "ungrounded", "absolute_zero", "r_zero", "threshold")
# the paper's orderings this table tests (its Table 3 / Figure 4 and the corpus ablation)
PAPER_CLAIMS = {"fixed_challenger": "co-evolving challenger beats a fixed one",
                "ungrounded": "corpus grounding beats self-play without documents (43.9 vs 40.7)",
                "absolute_zero": "the variance reward beats Absolute Zero's",
                "r_zero": "the variance reward beats R-Zero's",
                "threshold": "the variance reward beats a threshold reward"}


def last_items(run_dir: str, benchmark: str) -> tuple[int, list[dict]]:
    """The per-item records of the run's last held-out evaluation (eval/iteration_NNNN/...)."""
    from spice_megatron.eval.run import evaluation_records, items_file_name

    found = evaluation_records(os.path.join(run_dir, "eval"), items_file_name(benchmark))
    if not found:
        raise FileNotFoundError(f"{run_dir}: no per-item evaluation records under eval/ (benchmark {benchmark})")
    return max(found.items())


def kept_evaluation(run_dir: str, benchmark: str) -> dict:
    """What the comparisons need of a finished run: its last evaluation's items (id, correct) and,
    where it wrote them, its last held-out challenger tasks."""
    iteration, items = last_items(run_dir, benchmark)
    kept: dict = {"iteration": iteration, "items": [{"id": r["id"], "correct": bool(r["correct"])} for r in items]}
    written = sorted(glob.glob(os.path.join(run_dir, "challenger_eval", "iteration_*.json")))
    if written:
        with open(written[-1]) as f:
            kept["challenger_tasks"] = json.load(f)
    return kept


def aligned(arm: list[dict], spice: list[dict]) -> tuple[list[float], list[float]]:
    """Each held-out item's correctness (100 or 0) for the arm and for spice, in item-id order."""
    theirs = {r["id"]: 100.0 * bool(r["correct"]) for r in arm}
    ours = {r["id"]: 100.0 * bool(r["correct"]) for r in spice}
    if ours.keys() != theirs.keys():
        raise ValueError("the arm and spice were evaluated on different held-out items")
    ids = sorted(ours)
    return [theirs[i] for i in ids], [ours[i] for i in ids]


def paired_points(arm: list[dict], spice: list[dict], seed: int) -> tuple[float, float, float]:
    """(arm - spice) held-out accuracy in points over the same items, with its bootstrap interval."""
    from spice_megatron.eval.challenger_eval import paired_bootstrap

    return paired_bootstrap(*aligned(arm, spice), seed=seed)


def verdict(low: float, high: float) -> str:
    """What a (arm - spice) interval says."""
    if high < 0:
        return "SPICE better"
    if low > 0:
        return "arm better"
    return "no measurable difference"


def arm_summary(arm: str, per_seed: dict[int, dict]) -> dict:
    """Pooled over seeds: every seed's items paired with spice's of the same seed."""
    from spice_megatron.eval.challenger_eval import paired_bootstrap

    if arm == "spice":
        return {"arm": arm, "verdict": "reference", "diff": (0.0, 0.0, 0.0)}
    arm_correct = [c for s in per_seed.values() for c in s["item_correct"]]
    spice_correct = [c for s in per_seed.values() for c in s["spice_item_correct"]]
    d = paired_bootstrap(arm_correct, spice_correct, seed=min(per_seed))
    return {"arm": arm, "diff": d, "verdict": verdict(d[1], d[2]), "claim": PAPER_CLAIMS.get(arm, "")}


def verdict_line(summary: dict) -> str:
    d, lo, hi = summary["diff"]
    if summary["verdict"] == "reference":
        return f"{summary['arm']}: the reference"
    return (f"{summary['arm']}: {summary['verdict']} (held-out accuracy {summary['arm']} - spice {d:+.1f} points, "
            f"95% CI {lo:+.1f} to {hi:+.1f})")


def seed_figures(run: dict, items: list[dict], spice_items: list[dict], seed: int) -> dict:
    from learning_runs import wilson

    from spice_megatron.eval.challenger_eval import paired_bootstrap

    correct = sum(bool(r["correct"]) for r in items)
    item_correct, spice_item_correct = aligned(items, spice_items)
    return {"seed": seed, "accuracy": 100.0 * correct / len(items), "ci": wilson(correct, len(items)),
            "paired": paired_bootstrap(item_correct, spice_item_correct, seed=seed),
            "item_correct": item_correct, "spice_item_correct": spice_item_correct,
            "minutes": run["seconds"] / 60}


def markdown_table(summary: dict) -> str:
    """The generated table of docs/learning.md (tools/docs_tables.py) from the ablation's summary.json."""
    rows = ["| arm | seed | held-out accuracy (95% CI) | arm - spice, points (95% CI) | challenger variance reward "
            "(held-out) | verdict (pooled) |", "|---|---|---|---|---|---|"]
    for arm, a in summary["arms"].items():
        for s in a["seeds"]:
            d, lo, hi = s["paired"]
            ch = s.get("challenger", {}).get("variance_reward")
            rows.append(f"| {arm} | {s['seed']} | {s['accuracy']:.1f} ({s['ci'][0]:.1f}-{s['ci'][1]:.1f}) | "
                        + ("-" if arm == "spice" else f"{d:+.1f} ({lo:+.1f} to {hi:+.1f})") + " | "
                        + ("-" if ch is None else f"{ch:.3f}") + f" | {a['verdict']} |")
        if arm != "spice":  # the interval the verdict reads: every seed's items, paired
            d, lo, hi = a["diff"]
            rows.append(f"| {arm} | pooled | - | {d:+.1f} ({lo:+.1f} to {hi:+.1f}) | - | {a['verdict']} |")
    return "\n".join(rows)


def exact_table(runs_dir: str) -> str:
    """The committed runs under `runs_dir` (<arm>_<seed>.done.json) re-reported with exact paired
    tests: per arm, McNemar's exact one-sided test that SPICE is better (the binomial test on the
    items exactly one of the two got right, pooled over seeds: each seed's items are its own) and
    Holm's adjustment across the arms, beside the bootstrap interval the table above reads."""
    from spice_megatron.eval.stats import binomial_tail, holm, mcnemar

    kept: dict[str, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(runs_dir, "*.done.json"))):
        with open(path) as f:
            run = json.load(f)["result"]
        arm = os.path.basename(path)[:-len(".done.json")].rsplit("_", 1)[0]
        kept.setdefault(arm, {})[run["seed"]] = {r["id"]: bool(r["correct"]) for r in run["kept"]["items"]}
    rows, pooled = {}, {}
    for arm, seeds in kept.items():
        if arm == "spice":
            continue
        tests = []
        for seed in sorted(seeds):
            ids = sorted(kept["spice"][seed])
            tests.append((seed, mcnemar([seeds[seed][i] for i in ids], [kept["spice"][seed][i] for i in ids])))
        only_arm, only_spice = sum(t["only_arm"] for _, t in tests), sum(t["only_reference"] for _, t in tests)
        items = sum(t["items"] for _, t in tests)
        pooled[arm] = binomial_tail(only_spice, only_arm + only_spice)
        rows[arm] = (tests, 100.0 * (only_arm - only_spice) / items, only_arm, only_spice)
    adjusted = holm(pooled)
    out = ["| arm | seed | arm - spice, points | items only the arm / only spice got right | exact p, SPICE better "
           "(one-sided) | Holm-adjusted p (4 arms) |", "|---|---|---|---|---|---|"]
    for arm, (tests, diff, only_arm, only_spice) in rows.items():
        out += [f"| {arm} | {seed} | {t['diff']:+.1f} | {t['only_arm']} / {t['only_reference']} | "
                f"{t['p_reference_better']:.3g} | - |" for seed, t in tests]
        out.append(f"| {arm} | pooled | {diff:+.1f} | {only_arm} / {only_spice} | {pooled[arm]:.3g} | "
                   f"**{adjusted[arm]:.3g}**{' (holds at 0.05)' if adjusted[arm] < 0.05 else ''} |")
    return "\n".join(out)


def run_ablation(args, settings: dict, train_file: str, heldout: str, fixed_docs: list[dict]) -> int:
    """Every arm for every seed (resumable), then the paired comparisons, summary.json and the
    verdict lines. `args` and `settings` are learning_check's for --selfplay."""
    import learning_runs as lc

    benchmark = heldout  # the trainer's evaluation names a file benchmark by its spec
    runs: dict[str, dict] = {}
    for arm in args.arms:
        overrides = [o.format(model=args.model) for o in ARMS[arm]]
        for seed in args.seeds:
            name = f"{arm}_{seed}"
            arm_settings = {**settings, "arm": overrides}
            run = lc._finished(args.out, name, arm_settings)
            if run is None:
                base_extra = list(args.extra)
                args.extra = base_extra + overrides
                try:
                    run = lc._run(name, args.out, train_file, heldout, args, seed, args.lr)
                finally:
                    args.extra = base_extra
                run.pop("metrics")
                run["kept"] = kept_evaluation(os.path.join(args.out, name), benchmark)
                lc._keep(args.out, name, arm_settings, run)
            runs[name] = {**run, "arm": arm}
            print(f"{name}: done ({run['seconds'] / 60:.1f} min)", flush=True)
    # the held-out challenger: each challenger-training arm's tasks at its last evaluation, answered by the base model
    gold = {d["doc_id"]: d["answer"] for d in fixed_docs}
    trained = {n: r for n, r in runs.items() if r["arm"] in TRAINS_CHALLENGER}
    key = {**settings, "runs": sorted(trained), "last_only": True}
    scores = lc._finished(args.out, "ablation_challenger_scores", key) or lc._keep(
        args.out, "ablation_challenger_scores", key, lc.challenger_scores(args, trained, gold, last_only=True))
    scores = {n: {int(it): docs for it, docs in by_it.items()} for n, by_it in scores.items()}  # JSON keys: strings
    summary: dict = {"mode": "ablation", "seeds": args.seeds, "settings": settings, "arms": {}}
    for arm in args.arms:
        per_seed = {}
        for seed in args.seeds:
            name, ref = f"{arm}_{seed}", f"spice_{seed}"
            fig = seed_figures(runs[name], runs[name]["kept"]["items"], runs[ref]["kept"]["items"], seed)
            if scores.get(name):
                last = max(scores[name])
                fig["challenger"] = _challenger_figures(scores[name][last], scores.get(ref, {}).get(last), last, seed)
            per_seed[seed] = fig
        pooled = arm_summary(arm, per_seed)
        for fig in per_seed.values():  # the per-item lists served the pooling; summary.json keeps figures
            fig.pop("item_correct"), fig.pop("spice_item_correct")
        summary["arms"][arm] = {**pooled, "seeds": list(per_seed.values())}
    summary["run_minutes"] = sum(r["seconds"] for r in runs.values()) / 60
    for r in runs.values():
        r.pop("kept")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for arm, a in summary["arms"].items():
        print("ablation " + verdict_line(a), flush=True)
    print(f"ablation: {len(runs)} runs, {summary['run_minutes']:.1f} min of runs; table: {args.out}/summary.json",
          flush=True)
    return 0


def _challenger_figures(scored: list[dict], ref: list[dict] | None, iteration: int, seed: int) -> dict:
    """Held-out challenger means at the arm's last evaluation, and (arm - spice) over the same stories."""
    from spice_megatron.eval.challenger_eval import paired_bootstrap, summarise

    out = {"iteration": iteration, **{k: v for k, v in summarise(scored).items() if k != "pass_rate_histogram"}}
    if ref and [d["doc_id"] for d in ref] == [d["doc_id"] for d in scored]:
        out["variance_reward_vs_spice"] = paired_bootstrap([d["variance_reward"] for d in scored],
                                                           [d["variance_reward"] for d in ref], seed=seed)
    return out
