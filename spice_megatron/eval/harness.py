"""Generate answers to benchmark items, grade them, and write the paper-style table.

Prompts are the reasoner's (`tasks.reasoner_prompt`): the model is evaluated the way it was trained
to answer. Decoding is greedy, except for benchmarks scored as avg@k (AIME: 32 samples at
`sample_temperature`). Grading is `selfplay/verify.py`'s; an optional judge is asked only about answers the
rules reject, and what it accepted is marked in the per-item records.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

from spice_megatron.eval.benchmarks import LoadedBenchmark
from spice_megatron.selfplay.templates import prompt_token_ids, reasoner_prompt
from spice_megatron.tasks import extract_boxed
from spice_megatron.wire.types import Completion, SamplingSpec

log = logging.getLogger(__name__)

Generate = Callable[[list[str], SamplingSpec], list[list[Completion]]]


class Judge(Protocol):
    def __call__(self, prediction: str, gold: str) -> bool: ...


@dataclass
class EvalSettings:
    max_tokens: int = 4096
    sample_temperature: float = 0.6  # for avg@k benchmarks
    sample_top_p: float = 0.95
    seed: int = 1234
    template: str = "plain"  # the recipe's conversation template (templates.py): the training prompts
    prompt_dir: str = ""
    stop: tuple[str, ...] = ()  # the training reasoner's stop strings (selfplay.reasoner_stop)


@dataclass
class BenchmarkResult:
    name: str
    category: str
    status: str  # ok | unavailable
    reason: str = ""
    source: str = ""
    items: int = 0
    samples_per_item: int = 1
    expected_items: int | None = None  # the full set's size; the paper's setting (see benchmarks.py)
    correct: float = 0.0  # answers graded correct (the reported accuracy's), summed over samples
    accuracy: float = float("nan")  # percent; the judged score when a judge ran on a math set, else rules
    rule_accuracy: float = float("nan")  # percent, rules only (Math-Verify, exact match, letters)
    judged_accuracy: float = float("nan")  # percent, the judge asked about every extracted math answer
    judged_correct: int = 0  # answers the judge accepted
    judge_flips: int = 0  # answers where the judge and the rules disagree
    no_answer: int = 0  # answers without a \boxed{}
    skipped_records: int = 0
    template: str = ""
    seconds: float = 0.0


@dataclass
class EvalReport:
    model: str
    results: list[BenchmarkResult]
    summary: dict[str, float] = field(default_factory=dict)


def evaluate_benchmark(loaded: LoadedBenchmark, generate: Generate, verifier, tokenizer, settings: EvalSettings,
                       judge: Judge | None = None) -> tuple[BenchmarkResult, list[dict]]:
    """Math answers go to the judge (when one is given) whatever the rules said, as the paper's
    GPT-4o grading through simple-evals; the rules' verdict is reported next to it."""
    b, items = loaded.benchmark, loaded.items
    t0 = time.perf_counter()
    prompts = [reasoner_prompt(it.task(), settings.template, tokenizer, settings.prompt_dir) for it in items]
    if b.samples > 1:
        spec = SamplingSpec(n=b.samples, temperature=settings.sample_temperature, top_p=settings.sample_top_p,
                            max_tokens=settings.max_tokens, stop=settings.stop, seed=settings.seed, logprobs=False)
    else:
        spec = SamplingSpec(n=1, temperature=0.0, max_tokens=settings.max_tokens, stop=settings.stop, logprobs=False)
    outputs = generate([prompt_token_ids(p, tokenizer) for p in prompts] if tokenizer is not None else prompts, spec)
    flat = [(it, c, extract_boxed(c.text)) for it, comps in zip(items, outputs) for c in comps]
    verdicts = verifier.verify_batch([(pred, it.answer, it.answer_type) for it, _, pred in flat])
    use_judge = judge is not None and b.category == "math"
    records = []
    for (it, c, pred), ok in zip(flat, verdicts):
        judged = None  # not asked
        if use_judge:
            judged = bool(pred) and bool(judge(pred, it.answer))
        records.append({"benchmark": b.name, "id": it.id, "answer_type": it.answer_type, "gold": it.answer,
                        "extracted": pred, "rule_correct": ok, "judge_correct": judged,
                        "correct": judged if use_judge else ok, "finish_reason": c.finish_reason,
                        "template": settings.template, "output": c.text})
    n = len(records)

    def pct(key: str) -> float:
        return 100.0 * sum(bool(r[key]) for r in records) / n if n else float("nan")

    correct = float(sum(r["correct"] for r in records))
    result = BenchmarkResult(
        b.name, b.category, "ok", source=loaded.source, items=len(items), expected_items=b.expected_items,
        samples_per_item=b.samples, correct=correct, accuracy=100.0 * correct / n if n else float("nan"),
        rule_accuracy=pct("rule_correct"), judged_accuracy=pct("judge_correct") if use_judge else float("nan"),
        judged_correct=sum(bool(r["judge_correct"]) for r in records),
        judge_flips=sum(bool(r["judge_correct"]) != r["rule_correct"] for r in records) if use_judge else 0,
        no_answer=sum(r["extracted"] is None for r in records), skipped_records=sum(loaded.skipped.values()),
        template=settings.template, seconds=time.perf_counter() - t0)
    if b.expected_items is not None and loaded.limit is None and len(items) != b.expected_items:
        log.warning("%s: %d items, the paper's setting has %d (source %s)", b.name, len(items), b.expected_items,
                    loaded.source)
    return result, records


def summarise(results: list[BenchmarkResult]) -> dict[str, float]:
    """Unweighted means over available benchmarks, as the paper averages them."""
    def mean(cat: str | None) -> float:
        accs = [r.accuracy for r in results if r.status == "ok" and (cat is None or r.category == cat)]
        return sum(accs) / len(accs) if accs else float("nan")

    return {"math_average": mean("math"), "general_average": mean("general"), "overall_average": mean(None),
            "benchmarks_evaluated": float(sum(r.status == "ok" for r in results)),
            "benchmarks_unavailable": float(sum(r.status != "ok" for r in results))}


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def markdown_table(report: EvalReport) -> str:
    template = next((r.template for r in report.results if r.template), "")
    lines = [f"# Evaluation of `{report.model}`", "", f"Prompt template: `{template}`.", "",
             "| benchmark | category | accuracy (%) | rules (%) | judge (%) | items (paper) | samples/item | "
             "no \\boxed{} | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report.results:
        if r.status == "ok":
            expected = "?" if r.expected_items is None else str(r.expected_items)
            lines.append(f"| {r.name} | {r.category} | {_pct(r.accuracy)} | {_pct(r.rule_accuracy)} | "
                         f"{_pct(r.judged_accuracy)} | {r.items} ({expected}) | {r.samples_per_item} | "
                         f"{r.no_answer} | {r.source} |")
        else:
            lines.append(f"| {r.name} | {r.category} | unavailable | - | - | 0 | - | - | {r.reason} |")
    s = report.summary
    lines += ["", "| average | value (%) |", "|---|---|",
              f"| math | {_pct(s['math_average'])} |", f"| general | {_pct(s['general_average'])} |",
              f"| overall | {_pct(s['overall_average'])} |", "",
              f"{int(s['benchmarks_evaluated'])} benchmark(s) evaluated, {int(s['benchmarks_unavailable'])} "
              "unavailable. "
              "Greedy decoding; avg@k benchmarks sample k answers per item. With a judge, math sets report the "
              "judge's verdict on every answer (the paper's GPT-4o grading) and the rules' next to it."]
    return "\n".join(lines) + "\n"


def json_safe(obj):
    """NaN (an unavailable benchmark's accuracy, a pass rate over no answers) as null: strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def write_report(out_dir: str, report: EvalReport, records: list[dict]) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"), "markdown": os.path.join(out_dir, "results.md"),
             "items": os.path.join(out_dir, "items.jsonl")}
    with open(paths["json"], "w") as f:
        json.dump(json_safe({"model": report.model, "summary": report.summary,
                             "benchmarks": [asdict(r) for r in report.results]}), f, indent=2, allow_nan=False)
    with open(paths["markdown"], "w") as f:
        f.write(markdown_table(report))
    with open(paths["items"], "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return paths


# The paper graded math through simple-evals, whose checker shows a model two answers (never the
# problem) with worked examples and asks whether they are equivalent after trivial simplification.
# The same check, in this project's words and examples.
JUDGE_PROMPT = """Two answers to the same math problem are shown. Say whether they are the same answer. Allow only
simple rewriting: a fraction written as a decimal or in lowest terms, reordered terms, added or dropped
units, spacing, LaTeX markup, or "x = " before a value. Different values, or a form that needs real
work to show equal, are not the same.

First: 3/4
Second: 0.75
Same: Yes

First: \\frac{{1}}{{2}}
Second: 1/2
Same: Yes

First: x = 12
Second: 12 cm
Same: Yes

First: 2\\pi
Second: 6.28
Same: No

First: (1, 2)
Second: (2, 1)
Same: No

First: {gold}
Second: {prediction}
Same:"""


class LLMJudge:
    """A judge model behind rollout engines (a RolloutFleet) shown the answer pair only: greedy, one
    word, 'yes' accepts."""

    def __init__(self, fleet, tokenizer=None, max_tokens: int = 8):
        self.fleet, self.tokenizer, self.max_tokens = fleet, tokenizer, max_tokens
        self.calls = 0

    def __call__(self, prediction: str, gold: str) -> bool:
        text = JUDGE_PROMPT.format(gold=gold[:500], prediction=prediction[:500])
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        self.calls += 1
        ids = prompt_token_ids(text, self.tokenizer) if self.tokenizer is not None else text
        (reply,), = self.fleet.generate([ids], SamplingSpec(n=1, temperature=0.0, max_tokens=self.max_tokens,
                                                            logprobs=False))
        return reply.text.strip().lower().startswith("yes")
