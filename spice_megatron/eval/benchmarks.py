"""The paper's benchmarks by hub id, and the offline sets built by `spice prepare`.

Every benchmark becomes a list of `EvalItem`s in one shape: question, gold answer, answer type (the
verifier's: integer, expression, string, multiple_choice) and options. A record that cannot be
converted is skipped, counted and logged with its index and the missing field; a benchmark whose
data cannot be loaded at all raises `BenchmarkUnavailable` with the reason, and the report lists it.
"""
from __future__ import annotations

import json
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from spice_megatron.entry import UserError
from spice_megatron.tasks import ANSWER_LETTERS, INTEGER_ANSWER, Task, extract_boxed

log = logging.getLogger(__name__)


class BenchmarkUnavailable(UserError, RuntimeError):
    """The benchmark's data could not be loaded (offline, unknown id, missing file)."""


@dataclass(frozen=True)
class EvalItem:
    id: str
    question: str
    answer: str  # for multiple choice: the letter
    answer_type: str
    options: tuple[str, ...] = ()

    def task(self) -> Task:
        return Task(self.question, self.answer, self.answer_type, self.options)


@dataclass(frozen=True)
class Benchmark:
    name: str
    category: str  # math | general
    hub_id: str = ""
    hub_config: str | None = None
    split: str = "test"
    convert: Callable[[dict, int], EvalItem] | None = None  # hub record -> item
    offline_file: str = ""  # under the prepared data directory's eval/
    samples: int = 1  # > 1: the score is the mean over this many samples per item (avg@k)
    expected_items: int | None = None  # the set the paper's numbers are over (None: not stated)
    keep: Callable[[dict], bool] | None = None  # hub records that belong to the set


class RecordError(UserError, ValueError):
    pass


def _field(rec: dict, *names: str) -> Any:
    for n in names:
        if rec.get(n) not in (None, ""):
            return rec[n]
    raise RecordError(f"field {'/'.join(names)} is missing or empty")


def _math_type(answer: str) -> str:
    return "integer" if INTEGER_ANSWER.match(answer.strip()) else "expression"


def _free(id_field: tuple[str, ...], question: tuple[str, ...], answer: tuple[str, ...], prefix: str):
    def convert(rec: dict, i: int) -> EvalItem:
        ans = _field(rec, *answer)
        if isinstance(ans, list):  # OlympiadBench: a list of final answers
            ans = ans[0]
        ans = str(ans).strip().strip("$")
        ident = next((str(rec[k]) for k in id_field if rec.get(k) not in (None, "")), str(i))
        return EvalItem(f"{prefix}-{ident}", str(_field(rec, *question)), ans, _math_type(ans))
    return convert


def _gsm8k(rec: dict, i: int) -> EvalItem:
    solution = str(_field(rec, "answer"))
    if "####" not in solution:
        raise RecordError("field answer has no '#### <number>' line")
    ans = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return EvalItem(f"gsm8k-{i}", str(_field(rec, "question")), ans, "integer")


def _math500(rec: dict, i: int) -> EvalItem:
    ans = str(rec.get("answer") or extract_boxed(str(_field(rec, "solution"))) or "")
    if not ans:
        raise RecordError("field answer is missing and the solution has no \\boxed{}")
    return EvalItem(f"math500-{rec.get('unique_id', i)}", str(_field(rec, "problem")), ans, _math_type(ans))


def _mcq_with_letters(question: tuple[str, ...], prefix: str, letter_field: str):
    def convert(rec: dict, i: int) -> EvalItem:
        options = tuple(str(o) for o in _field(rec, "options"))
        if not 2 <= len(options) <= len(ANSWER_LETTERS):
            raise RecordError(f"field options has {len(options)} entries")
        letter = str(_field(rec, letter_field)).strip().upper()
        if letter not in ANSWER_LETTERS[:len(options)]:
            raise RecordError(f"field {letter_field}={letter!r} is not one of the options' letters")
        return EvalItem(f"{prefix}-{rec.get('question_id', rec.get('uuid', i))}", str(_field(rec, *question)),
                        letter, "multiple_choice", options)
    return convert


def _gpqa(rec: dict, i: int) -> EvalItem:
    correct = str(_field(rec, "Correct Answer")).strip()
    options = [correct] + [str(_field(rec, f"Incorrect Answer {k}")).strip() for k in (1, 2, 3)]
    # GPQA lists the correct answer first: shuffle with a seed per item, the same on every run
    random.Random(f"gpqa-{i}").shuffle(options)
    return EvalItem(f"gpqa-{rec.get('Record ID', i)}", str(_field(rec, "Question")),
                    ANSWER_LETTERS[options.index(correct)], "multiple_choice", tuple(options))


def _bbeh(rec: dict, i: int) -> EvalItem:
    ans = str(_field(rec, "target")).strip()
    kind = "integer" if INTEGER_ANSWER.match(ans) else "string"
    return EvalItem(f"bbeh-{rec.get('task', '')}-{i}", str(_field(rec, "input")), ans, kind)


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("math500", "math", "HuggingFaceH4/MATH-500", split="test", convert=_math500, offline_file="math500.jsonl",
              expected_items=500),
    Benchmark("gsm8k", "math", "openai/gsm8k", "main", "test", _gsm8k, offline_file="gsm8k_test.jsonl",
              expected_items=1319),
    Benchmark("minerva_math", "math", "math-ai/minervamath", split="test",
              convert=_free(("idx",), ("question", "problem"), ("answer",), "minerva"), expected_items=272),
    # the English, text-only, open-ended competition maths subset
    Benchmark("olympiadbench", "math", "Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
              _free(("id",), ("question",), ("final_answer",), "olympiad"), expected_items=675),
    # AMC 2023: the paper's scores are multiples of 2.5, so 40 problems; the AIMO validation set holds
    # 83 AMC problems of several years, of which the 40 from 2023 are kept by their source URL
    Benchmark("amc", "math", "AI-MO/aimo-validation-amc", split="train",
              convert=_free(("id",), ("problem",), ("answer",), "amc23"), expected_items=40,
              keep=lambda rec: "2023" in str(rec.get("url", ""))),
    Benchmark("aime24", "math", "HuggingFaceH4/aime_2024", split="train",
              convert=_free(("id",), ("problem",), ("answer",), "aime24"), samples=32, expected_items=30),
    Benchmark("aime25", "math", "math-ai/aime25", split="test",
              convert=_free(("id",), ("problem",), ("answer",), "aime25"), samples=32, expected_items=30),
    # the general sets: full test sets; the paper does not state a subset (docs/fidelity.md)
    Benchmark("mmlu_pro", "general", "TIGER-Lab/MMLU-Pro", split="test",
              convert=_mcq_with_letters(("question",), "mmlu_pro", "answer"), expected_items=12032),
    Benchmark("gpqa_diamond", "general", "Idavidrein/gpqa", "gpqa_diamond", "train", _gpqa, expected_items=198),
    Benchmark("supergpqa", "general", "m-a-p/SuperGPQA", split="train",
              convert=_mcq_with_letters(("question",), "supergpqa", "answer_letter"), expected_items=26529),
    Benchmark("bbeh", "general", "BBEH/bbeh", split="train", convert=_bbeh, expected_items=4520),
    # offline only (`spice prepare`): not in the paper's table, useful on machines without the hub
    Benchmark("mmlu", "general", offline_file="mmlu_test.jsonl"),
    Benchmark("arc_challenge", "general", offline_file="arc_challenge_test.jsonl"),
    # the CPU demo's held-out story questions (story_corpus.py): arithmetic no training story states
    Benchmark("stories", "math", offline_file="stories.jsonl"),
]}
PAPER_MATH = ("math500", "olympiadbench", "minerva_math", "gsm8k", "amc", "aime24", "aime25")
PAPER_GENERAL = ("mmlu_pro", "gpqa_diamond", "supergpqa", "bbeh")
PAPER_BENCHMARKS = PAPER_MATH + PAPER_GENERAL
OFFLINE_BENCHMARKS = ("gsm8k", "math500", "mmlu", "arc_challenge")


def file_benchmark(name: str) -> Benchmark:
    """'file:PATH' (optionally 'file:PATH:math'): a set of one's own, in the offline format
    ({"id", "question", "answer", "answer_type", "options"} per line)."""
    path, _, category = name[len("file:"):].partition(":")
    return Benchmark(name, category or "general", offline_file=os.path.abspath(path))


def get_benchmark(name: str) -> Benchmark:
    return file_benchmark(name) if name.startswith("file:") else BENCHMARKS[name]


def benchmark_names(spec: str) -> list[str]:
    """'paper', 'offline', or a comma-separated list (registry names or file:PATH[:math]); unknown
    names are an error that lists the known."""
    names = {"paper": list(PAPER_BENCHMARKS), "offline": list(OFFLINE_BENCHMARKS)}.get(spec)
    names = names or [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS and not (n.startswith("file:") and
                                                                os.path.isfile(file_benchmark(n).offline_file))]
    if unknown:
        raise ValueError(f"--benchmarks: unknown {unknown}; known: {', '.join(BENCHMARKS)} (or 'paper', 'offline')")
    return names


@dataclass
class LoadedBenchmark:
    benchmark: Benchmark
    items: list[EvalItem]
    source: str  # the file or hub id it came from
    skipped: Counter = field(default_factory=Counter)
    limit: int | None = None  # items were cut to this many (--limit)


def _offline_item(rec: dict, i: int) -> EvalItem:
    options = tuple(rec.get("options") or ())
    return EvalItem(str(rec.get("id", i)), str(_field(rec, "question")), str(_field(rec, "answer")),
                    str(_field(rec, "answer_type")), options)


def _convert_all(records, convert, where: str) -> tuple[list[EvalItem], Counter]:
    items, skipped = [], Counter()
    for i, rec in enumerate(records):
        try:
            items.append(convert(rec, i))
        except (RecordError, TypeError, KeyError) as e:
            skipped[str(e).split(" is ")[0][:60]] += 1
            if sum(skipped.values()) <= 5:
                log.warning("%s record %d skipped: %s", where, i, e)
    return items, skipped


def load_benchmark(name: str, data_dir: str = "", source: str = "auto", limit: int | None = None) -> LoadedBenchmark:
    """source: offline (the prepared file), hub, or auto (the prepared file when there is one)."""
    b = get_benchmark(name)
    if os.path.isabs(b.offline_file):
        path = b.offline_file
    else:
        path = os.path.join(data_dir, "eval", b.offline_file) if b.offline_file and data_dir else ""
    if source in ("offline", "auto") and path and os.path.exists(path):
        with open(path) as f:
            records = []
            for line_no, line in enumerate(f, 1):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    log.warning("%s:%d is not valid JSON; skipped", path, line_no)
        items, skipped = _convert_all(records, _offline_item, path)
        where = path
    elif source == "offline" or not b.hub_id:
        raise BenchmarkUnavailable(f"no offline file ({path or 'this benchmark has none'}); run `spice prepare`"
                                   if b.offline_file else "not available offline; it needs the hub")
    else:
        try:
            import datasets

            ds = datasets.load_dataset(b.hub_id, b.hub_config, split=b.split)
        except Exception as e:  # noqa: BLE001 - offline, gated, renamed: the report says why
            raise BenchmarkUnavailable(f"{b.hub_id}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
        items, skipped = _convert_all([r for r in ds if b.keep(r)] if b.keep else ds, b.convert, b.hub_id)
        where = b.hub_id
    if skipped:
        log.warning("%s: %d record(s) skipped: %s", name, sum(skipped.values()), dict(skipped))
    if not items:
        raise BenchmarkUnavailable(f"{where}: no usable records ({dict(skipped)})")
    return LoadedBenchmark(b, items[:limit] if limit else items, where, skipped, limit)
