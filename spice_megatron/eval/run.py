"""`spice eval`: a model (HF directory, SPICE run, or Megatron checkpoint) on a set of benchmarks,
generated through rollout engines (started here, or given), graded, tabulated."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import replace

from spice_megatron.bridge.convert import TRAINING_PROMPTS_FILE, read_training_prompts
from spice_megatron.eval.benchmarks import BenchmarkUnavailable, get_benchmark, load_benchmark
from spice_megatron.eval.harness import (
    BenchmarkResult,
    EvalReport,
    EvalSettings,
    Judge,
    evaluate_benchmark,
    summarise,
    write_report,
)

log = logging.getLogger(__name__)


def with_training_prompts(settings: EvalSettings, model_dir: str) -> EvalSettings:
    """Settings without a template (neither --recipe nor --template given) take the prompts the model
    was trained with, which an exported SPICE model records (spice_prompts.json); others use plain."""
    if settings.template:
        return settings
    recorded = read_training_prompts(model_dir)
    if recorded is None:
        return replace(settings, template="plain")
    prompt_dir = recorded.get("prompt_dir") or ""
    if prompt_dir and not os.path.isdir(prompt_dir):
        raise FileNotFoundError(f"{model_dir}/{TRAINING_PROMPTS_FILE}: the training prompt_dir {prompt_dir} is "
                                "missing; "
                                "pass --recipe or --template to evaluate with other prompts")
    log.info("evaluating with the training prompts of %s: recipe %s, template %s", model_dir, recorded.get("recipe"),
             recorded["template"])
    return replace(settings, template=recorded["template"], prompt_dir=prompt_dir,
                   stop=tuple(recorded.get("reasoner_stop") or ()))


def resolve_eval_model(path: str, work_dir: str) -> str:
    """An HF directory for `path`: itself, a run's hf_final/, or a Megatron checkpoint (root or
    step directory) converted into work_dir/hf_model."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if os.path.exists(os.path.join(path, "hf_final", "config.json")):
        return os.path.join(path, "hf_final")
    ckpt = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    if not (os.path.exists(os.path.join(ckpt, "latest")) or os.path.exists(os.path.join(ckpt, "layout.json"))):
        raise FileNotFoundError(f"--model {path}: neither an HF directory (config.json), a SPICE run (hf_final/) "
                                f"nor a Megatron checkpoint (latest or layout.json)")
    from spice_megatron.bridge.preflight import check_checkpoint

    check_checkpoint(ckpt, "--model")  # a damaged checkpoint names its file here, not in the child's traceback
    out = os.path.join(work_dir, "hf_model")
    # a fresh process: the conversion initialises torch.distributed for its own world of one
    code = ("import sys; from spice_megatron.bridge.convert import convert_to_hf; "
            "convert_to_hf(sys.argv[1], sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, ckpt, out], check=True)
    return out


def run_evaluation(model: str, names: list[str], out_dir: str, data_dir: str = "", source: str = "auto",
                   limit: int | None = None, settings: EvalSettings | None = None, engines: list[str] | None = None,
                   token: str = "", judge: Judge | None = None, kv_cache_gib: float = 1.0,
                   max_model_len: int = 8192) -> tuple[EvalReport, dict[str, str]]:
    from transformers import AutoTokenizer

    from spice_megatron.rollout.fleet import RolloutFleet
    from spice_megatron.rollout.local import local_fleet
    from spice_megatron.selfplay.verify import AnswerVerifier
    from spice_megatron.wire.auth import read_token

    settings = settings or EvalSettings()
    model_dir = resolve_eval_model(model, out_dir)
    settings = with_training_prompts(settings, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if engines:  # already serving this model
        attached = RolloutFleet(engines, token or read_token())  # $SPICE_ROLLOUT_TOKEN or its file
        attached.wait_until_healthy(timeout=120)
        fleet_ctx = contextlib.closing(attached)
    else:
        fleet_ctx = local_fleet(model_dir, os.path.join(out_dir, "logs"), max_model_len, kv_cache_gib, settings.seed)
    results: list[BenchmarkResult] = []
    records: list[dict] = []
    verifier = AnswerVerifier()
    try:
        with fleet_ctx as fleet:
            for name in names:
                try:
                    loaded = load_benchmark(name, data_dir, source, limit)
                except BenchmarkUnavailable as e:
                    log.warning("benchmark %s unavailable: %s", name, e)
                    results.append(BenchmarkResult(name, get_benchmark(name).category, "unavailable", reason=str(e)))
                    continue
                log.info("evaluating %s: %d items from %s", name, len(loaded.items), loaded.source)
                result, recs = evaluate_benchmark(loaded, fleet.generate, verifier, tokenizer, settings, judge)
                results.append(result)
                records.extend(recs)
    finally:
        verifier.close()
    report = EvalReport(model, results, summarise(results))
    return report, write_report(out_dir, report, records)


def training_eval_hook(names: list[str], data_dir: str, tokenizer, settings: EvalSettings, limit: int | None = None,
                       out_dir: str = ""):
    """The trainer's evaluation hook: the given benchmarks through the training fleet (which holds
    the current weights); returns accuracies and averages, logged under eval/. With `out_dir`, each
    evaluation's per-item records go to out_dir/iteration_NNNN/NAME.items.jsonl (paired comparisons
    of runs on the same items: tools/checks/learning_ablation.py)."""
    from tqdm.auto import tqdm

    from spice_megatron.selfplay.verify import AnswerVerifier

    loaded, verifier = {}, None
    for name in names:
        try:
            loaded[name] = load_benchmark(name, data_dir, "auto", limit)
        except BenchmarkUnavailable as e:
            log.warning("evaluation during training: %s unavailable (%s); left out", name, e)

    def hook(iteration: int, fleet) -> dict[str, float]:
        nonlocal verifier
        verifier = verifier or AnswerVerifier(processes=1)
        results = []
        for b in loaded.values():
            result, records = evaluate_benchmark(b, fleet.generate, verifier, tokenizer, settings)
            results.append(result)
            tqdm.write(held_out_line(f"held-out accuracy at iteration {iteration}", result.name, result.correct,
                                     result.items, result.samples_per_item))
            if out_dir:
                _write_items(os.path.join(out_dir, f"iteration_{iteration:04d}", items_file_name(result.name)), records)
        out = {r.name: r.accuracy for r in results}
        out.update({k: v for k, v in summarise(results).items() if k.endswith("average")})
        return out

    return hook


def held_out_line(what: str, benchmark: str, correct: float, items: int, samples: int = 1) -> str:
    """'WHAT (BENCHMARK, N items, greedy): A% (95% CI L-H)' for the progress output (the interval is
    over items: avg@k's samples of one item are not independent)."""
    from spice_megatron.eval.stats import wilson

    decoding = "greedy" if samples == 1 else f"avg@{samples}"
    lo, hi = wilson(correct / samples, items)
    share = 100.0 * correct / samples / max(items, 1)
    return f"{what} ({shown_name(benchmark)}, {items} items, {decoding}): {share:.1f}% (95% CI {lo:.1f}-{hi:.1f})"


def shown_name(benchmark: str) -> str:
    """A benchmark as a progress line names it: a file benchmark ('file:PATH[:math]') by its file's name."""
    return os.path.basename(benchmark[len("file:"):].split(":")[0]) if benchmark.startswith("file:") else benchmark


def held_out_change(eval_dir: str) -> list[str]:
    """'  held-out accuracy (B, N items, greedy): A% (95% CI) -> A% (95% CI), iteration 0 -> K' per
    benchmark a run measured before its first iteration and after (its per-item records under
    `eval_dir`, out_dir of training_eval_hook); without the measure before (run.eval_before=false),
    each evaluation it has, by iteration; none when it evaluated nothing."""
    from spice_megatron.eval.stats import wilson

    done = sorted(d for d in os.listdir(eval_dir) if d.startswith("iteration_")) if os.path.isdir(eval_dir) else []
    if not done:
        return []
    lines = []
    for name in sorted(f for f in os.listdir(os.path.join(eval_dir, done[-1])) if f.endswith(".items.jsonl")):
        by_iteration = {i: r for i, r in evaluation_records(eval_dir, name).items() if r}
        if not by_iteration:
            continue
        last = max(by_iteration)
        shown = {}
        for iteration, records in by_iteration.items():
            items = len({r["id"] for r in records})
            share = sum(bool(r["correct"]) for r in records) / len(records)
            lo, hi = wilson(share * items, items)
            shown[iteration] = f"{100 * share:.1f}% (95% CI {lo:.1f}-{hi:.1f})"
        records = by_iteration[last]
        samples = len(records) // max(items, 1)
        head = (f"  held-out accuracy ({shown_name(records[0]['benchmark'])}, {items} items, "
                f"{'greedy' if samples == 1 else f'avg@{samples}'}): ")
        if 0 in shown and last > 0:
            lines.append(f"{head}{shown[0]} -> {shown[last]}, iteration 0 -> {last}")
        else:  # no base-model measure to compare with
            lines.append(head + ", ".join(f"{shown[i]} at iteration {i}" for i in sorted(shown)))
    return lines


def evaluation_records(eval_dir: str, file_name: str = "") -> dict[int, list[dict]]:
    """A run's per-item evaluation records (training_eval_hook's out_dir, eval_dir/iteration_NNNN/),
    by iteration: those of `file_name` (items_file_name's), or of an iteration's one benchmark."""
    from spice_megatron.run.log import read_jsonl

    found = {}
    for d in sorted(os.listdir(eval_dir)) if os.path.isdir(eval_dir) else []:
        names = [file_name] if file_name else os.listdir(os.path.join(eval_dir, d))
        if d.startswith("iteration_") and len(names) == 1 and os.path.exists(os.path.join(eval_dir, d, names[0])):
            found[int(d.split("_")[1])] = list(read_jsonl(os.path.join(eval_dir, d, names[0])))
    return found


def items_file_name(benchmark: str) -> str:
    """A benchmark's per-item records file: its name with path separators and the like replaced
    (a file benchmark is named by its path)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", benchmark).strip("_") + ".items.jsonl"


def _write_items(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(path + ".tmp", path)
