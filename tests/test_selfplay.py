import json
import random
import re
from collections import Counter

import pytest

from spice_megatron.config import SelfPlayConfig
from spice_megatron.data.corpus import Document
from spice_megatron.selfplay.iteration import run_iteration
from spice_megatron.selfplay.templates import prompt_token_ids
from spice_megatron.wire.types import Completion, SamplingSpec


def doc(i, text):
    return Document(f"src/{i}/0", text, "src", i, 0, f"sha{i}", 10)


def task_text(question, answer_type, answer, options=None):
    opts = "<options>\n" + "\n".join(f"{x}) {o}" for x, o in zip("ABCD", options)) + "\n</options>\n" if options else ""
    return f"<question>{question}</question>\n<answer_type>{answer_type}</answer_type>\n{opts}<answer>{answer}</answer>"


class ScriptedModel:
    """A stand-in for the LLM only: documents script what the challenger writes, questions script
    how many of the G reasoner answers are right."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, sampling: SamplingSpec):
        self.calls.append((sampling.role, len(prompts), sampling.n))
        return [[self._one(p, sampling, j) for j in range(sampling.n)] for p in prompts]

    def _one(self, prompt, sampling, j):
        if sampling.role == "challenger":
            spec = re.search(r"SPEC\[(\w+)\]", prompt).group(1)
            if spec == "never":
                return Completion("I cannot write a task.", [1, 2, 3])
            if spec == "late" and self.calls.count(("challenger", 1, sampling.n)) < 2:
                return Completion("<question>unfinished", [1])
            if spec == "mcq":
                return Completion(task_text("Which metal? K=2", "multiple_choice", "C", ["Tin", "Iron", "Lead",
                                                                                         "Zinc"]),
                                  [1, 2])
            if spec == "mcqleak":  # the answer glued onto option D, as the paper's "Correct: C" line would be
                return Completion(task_text("Which metal? K=2", "multiple_choice", "C",
                                            ["Tin", "Iron", "Lead", "Zinc Correct: C"]), [1, 2])
            k = 4 if spec == "late" else int(spec[1:])
            return Completion(task_text(f"How many things are there here? K={k}", "integer", "42"), [1, 2, 3, 4])
        k = int(re.search(r"K=(\d)", prompt).group(1))
        right = "C" if "Which metal" in prompt else "42"
        return Completion(f"Thinking... \\boxed{{{right if j < k else '7'}}}", [5] * 6)


def run(docs, **cfg):
    """The compact protocol with one challenger sample per document (selfplay.challenger_group=single)."""
    cfg = SelfPlayConfig(**{"batch_docs": len(docs), "group_size": 8, "attempts_per_round": 4,
                            "protocol": "compact", "challenger_group": "single", **cfg})
    model = ScriptedModel()
    result = run_iteration(docs, model, _verifier(), cfg, random.Random(0), rollout_version=3, iteration=5)
    return result, model


_V = None


def _verifier():
    global _V
    if _V is None:
        from spice_megatron.selfplay.verify import AnswerVerifier
        _V = AnswerVerifier(processes=1)
    return _V


def test_one_iteration_end_to_end():
    docs = [doc(0, "SPEC[k4]"), doc(1, "SPEC[k8]"), doc(2, "SPEC[never]"), doc(3, "SPEC[mcq]")]
    result, model = run(docs, max_attempts=8)
    s = result.stats
    assert s["valid_task_rate"] == pytest.approx(0.75)
    # docs 0, 1, 3 are done after one round of 4; doc 2 spends its whole budget of 8.
    assert s["attempts_per_doc"] == pytest.approx((4 + 4 + 8 + 4) / 4) and s["attempts_per_doc_max"] == 8
    assert s["mix/multiple_choice"] == pytest.approx(1 / 3) and s["mix/integer"] == pytest.approx(2 / 3)
    assert s["pass_hist/4"] == 1 and s["pass_hist/8"] == 1 and s["pass_hist/2"] == 1
    assert s["reasoner/pass_rate"] == pytest.approx((4 + 8 + 2) / 24)
    assert s["invalid/no_question"] == pytest.approx(8 / 20)

    ch = [x for x in result.samples if x.role == "challenger"]
    rs = [x for x in result.samples if x.role == "reasoner"]
    assert len(ch) == 4 and len(rs) == 24  # one challenger sample per document, G per task
    rewards = {x.doc_id: x.reward for x in ch}
    assert rewards["src/0/0"] == pytest.approx(1.0)
    assert rewards["src/1/0"] == pytest.approx(0.0439, abs=1e-4)
    assert rewards["src/2/0"] == pytest.approx(-0.1)  # no valid task: the penalty
    assert rewards["src/3/0"] == pytest.approx(0.8226, abs=1e-4)
    mean_c = sum(rewards.values()) / 4
    assert all(x.advantage == pytest.approx(x.reward - mean_c) for x in ch)
    # Reasoner advantages are centred per question: doc 0's group has 4/8 right.
    g0 = [x for x in rs if x.doc_id == "src/0/0"]
    assert sorted({round(x.advantage, 6) for x in g0}) == [-0.5, 0.5]
    assert sum(x.advantage for x in rs) == pytest.approx(0.0)
    assert model.calls[0] == ("challenger", 4, 4) and ("reasoner", 3, 8) in model.calls


def test_audit_records_trace_every_output():
    docs = [doc(0, "SPEC[k4]"), doc(1, "SPEC[never]")]
    result, _ = run(docs, max_attempts=4)
    ch = [r for r in result.records if r["kind"] == "challenger"]
    rs = [r for r in result.records if r["kind"] == "reasoner"]
    assert len(ch) == 8 and len(rs) == 8  # every challenger attempt and every answer
    assert all(r["rollout_version"] == 3 and r["iteration"] == 5 and r["doc_id"] for r in result.records)
    trained = [r for r in ch if r["trained"]]
    assert len(trained) == 2 and {r["doc_id"] for r in trained} == {"src/0/0", "src/1/0"}
    valid = [r for r in trained if r["valid"]][0]
    assert all(r["challenger_record"] == result.records.index(valid) for r in rs)
    assert valid["task"]["answer"] == "42" and valid["pass_rate"] == 0.5 and valid["reward"] == pytest.approx(1.0)
    assert all("advantage" in r and r["extracted"] in ("42", "7") for r in rs)
    assert sum(r["trained"] for r in result.records if r["kind"] == "reasoner") == 8


def test_challenger_retries_until_valid():
    result, model = run([doc(0, "SPEC[late]")], max_attempts=16)
    assert result.stats["valid_task_rate"] == 1.0
    assert [c for c in model.calls if c[0] == "challenger"] == [("challenger", 1, 4)] * 2
    assert result.stats["attempts_per_doc"] == 8


def test_attempt_budget_not_multiple_of_round():
    result, model = run([doc(0, "SPEC[never]")], max_attempts=6)
    assert [c[2] for c in model.calls if c[0] == "challenger"] == [4, 2]
    assert result.stats["attempts_per_doc"] == 6 and result.stats["valid_task_rate"] == 0.0


@pytest.mark.parametrize("kind,expected", [("threshold", 1.0), ("absolute_zero", 0.5), ("r_zero", 1.0)])
def test_ablation_rewards_flow_through(kind, expected):
    result, _ = run([doc(0, "SPEC[k4]")], challenger_reward=kind)
    assert [x.reward for x in result.samples if x.role == "challenger"] == [pytest.approx(expected)]


# ----------------------------------------------------------------------------- the paper's protocol and groups

class PaperScriptedModel:
    """A stand-in LLM for the paper protocol. A document `PLAN[v/t]` gives a valid selection every
    time, and its k-th generation is a valid task when k mod t < v (`PLAN[late]`: the first round
    fails, the second gives one valid task; `PLAN[badsel]`: selections are never valid JSON).
    Reasoners answer a question `K=k` right k times out of G."""

    def __init__(self):
        self.calls, self.generations = [], Counter()

    def __call__(self, prompts, sampling: SamplingSpec):
        kind = "reasoner" if sampling.role == "reasoner" else (
            "selection" if "suitable_for_mcq" in prompts[0] else "generation")
        self.calls.append((kind, len(prompts), sampling.n, sampling.max_tokens))
        return [[self._one(kind, p, j) for j in range(sampling.n)] for p in prompts]

    def _one(self, kind, prompt, j):
        if kind == "selection":
            if "PLAN[badsel]" in prompt:
                return Completion("I would pick multiple choice.", [1, 2])
            mcq = "PLAN[mcq" in prompt
            return Completion('<think>the text has numbers {maybe}</think>\n{"suitable_for_mcq": %s, '
                              '"suitable_for_free_form": %s, "best_answer_type": %s, "reason": "numbers"}'
                              % (str(mcq).lower(), str(not mcq).lower(), "null" if mcq else '"Integer"'), [1, 2, 3])
        if kind == "generation":
            plan = re.search(r"PLAN\[([\w/]+)\]", prompt).group(1)
            k = self.generations[plan]
            self.generations[plan] += 1
            if plan == "late":
                ok, key = k == 8, 4
            elif plan.startswith("mcq"):
                ok, key = True, 2
            else:
                v, t = map(int, plan.split("/"))
                ok, key = k % t < v, 4
            if not ok:
                return Completion('{"question": "", "answer": "", "answer_type": "Integer"}', [9] * 3)
            if plan.startswith("mcq"):
                body = {"multiple_choice_question": f"Which metal? K={key}\nA) Tin\nB) Iron\nC) Lead\nD) Zinc",
                        "multiple_choice_correct": "C", "question_difficulty": "Hard"}
            else:
                body = {"question": f"How many items {plan} #{k}? K={key}", "answer": "42", "answer_type": "Integer",
                        "difficulty_level": "Hard"}
            return Completion("Let me think about the document first.\n```json\n" + json.dumps(body) + "\n```",
                              [7] * 5)
        k = int(re.search(r"K=(\d)", prompt).group(1))
        right = "C" if "Which metal" in prompt else "42"
        return Completion(f"Thinking... \\boxed{{{right if j < k else '7'}}}", [5] * 6)


def run_paper(docs, **cfg):
    cfg = SelfPlayConfig(**{"batch_docs": len(docs), "group_size": 8, "attempts_per_round": 8, "max_attempts": 16,
                            **cfg})
    model = PaperScriptedModel()
    return run_iteration(docs, model, _verifier(), cfg, random.Random(0), rollout_version=3, iteration=5), model


@pytest.mark.parametrize("valid,invalid,expected", [
    (3, 5, (3, 5)),  # exactly G attempts: all of them
    (1, 15, (1, 7)),  # 8 x 1/16 = 0.5, rounded half up
    (5, 11, (3, 5)),  # 8 x 5/16 = 2.5 -> 3
    (12, 4, (6, 2)), (0, 20, (0, 8)), (9, 0, (8, 0)),
    (1, 1000, (1, 7)),  # 0.008 rounds to 0, but a valid task always gets a place (the reasoner needs one)
    (2, 1, (2, 1)),  # fewer than G attempts (max_attempts < G): the group is all of them
])
def test_challenger_group_keeps_the_valid_invalid_ratio(valid, invalid, expected):
    from spice_megatron.selfplay.doc_rollout import group_counts

    assert group_counts(valid, invalid, 8) == expected


def test_paper_groups_train_invalid_attempts_and_centre_per_document():
    docs = [doc(0, "PLAN[3/8]"), doc(1, "PLAN[0/8]"), doc(2, "PLAN[late]"), doc(3, "PLAN[mcq]")]
    result, model = run_paper(docs)
    ch = [x for x in result.samples if x.role == "challenger"]
    rs = [x for x in result.samples if x.role == "reasoner"]
    by_doc = lambda xs, i: [x for x in xs if x.doc_id == f"src/{i}/0"]  # noqa: E731
    # 8 challenger trajectories per document, invalid ones included; 8 reasoner ones per document with a task
    assert [len(by_doc(ch, i)) for i in range(4)] == [8, 8, 8, 8]
    assert [len(by_doc(rs, i)) for i in range(4)] == [8, 0, 8, 8]
    # doc 0: 3 valid tasks (K=4: variance reward 1.0) and 5 invalid (rho): centred in its own group
    d0 = by_doc(ch, 0)
    assert sorted(round(x.reward, 4) for x in d0) == [-0.1] * 5 + [1.0] * 3
    mean0 = (3 * 1.0 - 5 * 0.1) / 8
    assert all(x.advantage == pytest.approx(x.reward - mean0) for x in d0)
    # doc 1 never wrote a task: all rho, advantage 0 (no signal, no crash)
    assert all(x.reward == pytest.approx(-0.1) and x.advantage == pytest.approx(0.0) for x in by_doc(ch, 1))
    # doc 2: one valid of 16 attempts -> 1 valid + 7 invalid
    assert sorted(x.reward > 0 for x in by_doc(ch, 2)) == [False] * 7 + [True]
    # doc 3: all 8 valid MCQ tasks, same reward: advantages 0 within the document (not the batch)
    assert all(x.advantage == pytest.approx(0.0) for x in by_doc(ch, 3))
    assert sum(x.advantage for x in ch) == pytest.approx(0.0)
    s = result.stats
    assert s["challenger/samples"] == 32 and s["reasoner/samples"] == 24
    assert s["challenger/group_valid"] == pytest.approx((3 + 0 + 1 + 8) / 4)
    assert s["challenger/group_invalid"] == pytest.approx((5 + 8 + 7 + 0) / 4)
    assert s["challenger/groups_without_task"] == 1 and s["valid_task_rate"] == pytest.approx(0.75)
    assert s["selection_valid_rate"] == 1.0 and s["invalid/no_question"] > 0
    # every valid task of a group is answered G times: 3 + 1 + 8 tasks
    reasoner_calls = [c for c in model.calls if c[0] == "reasoner"]
    assert reasoner_calls == [("reasoner", 12, 8, 2048)]
    # the selection step has its own token budget
    assert [c[3] for c in model.calls if c[0] == "selection"][0] == 512


def test_the_reasoner_group_reuses_the_variance_answers():
    result, _ = run_paper([doc(0, "PLAN[3/8]")])
    rs = [x for x in result.samples if x.role == "reasoner"]
    answers = [r for r in result.records if r["kind"] == "reasoner"]
    assert len(answers) == 24 and sum(r["trained"] for r in answers) == 8  # 3 tasks answered, one trained
    trained_task = {r["task_index"] for r in answers if r["trained"]}
    assert len(trained_task) == 1
    # the trained answers are exactly the answers that gave the chosen task its variance reward
    (k,) = trained_task
    task_answers = [r for r in answers if r["task_index"] == k]
    assert [x.completion.text for x in rs] == [r["text"] for r in task_answers]
    chosen = result.records[task_answers[0]["challenger_record"]]
    assert chosen["reasoner_group"] is True and chosen["outcomes"] == [r["correct"] for r in task_answers]
    assert sorted({round(x.advantage, 6) for x in rs}) == [-0.5, 0.5]


class FrontierScriptedModel(PaperScriptedModel):
    """PLAN[8/8] with one task at the frontier: generation #5 is answered right 3 times of 8, the
    other seven by everyone (K=8) or nobody (K=0)."""

    def _one(self, kind, prompt, j):
        out = super()._one(kind, prompt, j)
        if kind == "generation":
            k = self.generations["8/8"] - 1
            out = Completion(out.text.replace("K=4", f"K={3 if k == 5 else 8 * (k % 2)}"), out.token_ids)
        return out


@pytest.mark.parametrize("mode", ["random", "frontier"])
def test_the_reasoner_task_is_drawn_among_frontier_tasks_under_reasoner_task_frontier(mode):
    """reasoner_task=frontier (dynamic sampling) trains the reasoner on a task whose G answers disagree;
    the paper's random draw lands on it 1 time in 8."""
    trained = []
    for seed in range(16):
        cfg = SelfPlayConfig(batch_docs=1, group_size=8, attempts_per_round=8, max_attempts=8, reasoner_task=mode)
        result = run_iteration([doc(0, "PLAN[8/8]")], FrontierScriptedModel(), _verifier(), cfg, random.Random(seed),
                               rollout_version=0, iteration=0)
        rs = [x for x in result.samples if x.role == "reasoner"]
        trained.append(any(abs(x.advantage) > 0 for x in rs))
    if mode == "frontier":
        assert all(trained)
    else:
        assert 0 < sum(trained) < len(trained)


def test_a_document_without_frontier_tasks_still_trains_the_reasoner_on_one_of_them():
    class Solved(PaperScriptedModel):  # every task answered right by all G
        def _one(self, kind, prompt, j):
            out = super()._one(kind, prompt, j)
            return Completion(out.text.replace("K=4", "K=8"), out.token_ids) if kind == "generation" else out

    cfg = SelfPlayConfig(batch_docs=1, group_size=8, attempts_per_round=8, max_attempts=8, reasoner_task="frontier")
    result = run_iteration([doc(0, "PLAN[3/8]")], Solved(), _verifier(), cfg, random.Random(0), rollout_version=0,
                           iteration=0)
    rs = [x for x in result.samples if x.role == "reasoner"]
    assert len(rs) == 8 and all(x.reward == 1.0 and x.advantage == 0.0 for x in rs)


def test_audit_trail_marks_the_trained_attempts_with_their_selection():
    result, _ = run_paper([doc(0, "PLAN[3/8]"), doc(1, "PLAN[badsel]")])
    ch = [r for r in result.records if r["kind"] == "challenger"]
    assert len(ch) == 8 + 16  # every attempt is recorded
    assert sum(r["trained"] for r in ch) == 16 and all("advantage" in r for r in ch if r["trained"])
    d0 = [r for r in ch if r["doc_id"] == "src/0/0"]
    assert all('"suitable_for_mcq": false' in r["selection"] for r in d0)
    assert sum(r["valid"] for r in d0 if r["trained"]) == 3
    d1 = [r for r in ch if r["doc_id"] == "src/1/0"]
    assert all(r["reason"] == "selection_no_json" and "selection" not in r for r in d1)
    # a failed selection is itself the trajectory that takes the penalty
    bad = [x for x in result.samples if x.doc_id == "src/1/0"]
    assert len(bad) == 8 and all(x.completion.text == "I would pick multiple choice." for x in bad)
    assert result.stats["selection_valid_rate"] == pytest.approx(8 / 24)


def test_paper_protocol_prompts_come_from_files(tmp_path):
    (tmp_path / "selection.txt").write_text("PUBLISHED SELECTION {document} suitable_for_mcq {\"json\": true}")
    (tmp_path / "generate_free_form.txt").write_text("PUBLISHED FREE {answer_type}: {document}")
    (tmp_path / "reasoner.txt").write_text("PUBLISHED REASONER {question}")
    model = PaperScriptedModel()
    cfg = SelfPlayConfig(batch_docs=1, group_size=8, attempts_per_round=8, max_attempts=8, prompt_dir=str(tmp_path),
                         template="qwen3")
    seen = []

    def generate(prompts, spec):
        seen.extend(prompts)
        return model(prompts, spec)

    run_iteration([doc(0, "PLAN[8/8]")], generate, _verifier(), cfg, random.Random(0))
    assert any(p.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                            "PUBLISHED SELECTION PLAN[8/8] suitable_for_mcq {\"json\": true}") for p in seen)
    assert any("PUBLISHED FREE Integer: PLAN[8/8]" in p for p in seen)
    assert any("PUBLISHED REASONER How many items" in p for p in seen)


def test_weight_versions_are_recorded_per_output_and_per_role():
    """Each attempt and answer keeps the weight-version spans of its tokens; a challenger task
    records the versions of the answers its reward came from (newer at staleness 1, or mid-rollout)."""
    model = ScriptedModel()

    def stamped(prompts, sampling):  # the challenger sampled by version 3, the answers by 3 and 4
        out = model(prompts, sampling)
        for comps in out:
            for j, c in enumerate(comps):
                n = len(c.token_ids)
                c.versions = ([[3, 0, n]] if sampling.role == "challenger" or j % 2 == 0
                              else [[3, 0, n // 2], [4, n // 2, n]])
        return out

    cfg = SelfPlayConfig(batch_docs=1, group_size=4, attempts_per_round=2, protocol="compact",
                         challenger_group="single")
    result = run_iteration([doc(0, "SPEC[k2]")], stamped, _verifier(), cfg, random.Random(0), rollout_version=3)
    ch = [r for r in result.records if r["kind"] == "challenger"]
    rs = [r for r in result.records if r["kind"] == "reasoner"]
    assert all(r["versions"] == [[3, 0, 4]] for r in ch)
    assert [r["versions"] for r in rs] == [[[3, 0, 6]], [[3, 0, 3], [4, 3, 6]]] * 2
    answered = [r for r in ch if "answer_versions" in r]  # the attempts whose tasks were answered
    assert answered and all(r["answer_versions"] == [3, 4] for r in answered)
    trained = [s for s in result.samples if s.role == "reasoner"]
    assert {tuple(map(tuple, s.completion.versions)) for s in trained} == {((3, 0, 6),), ((3, 0, 3), (4, 3, 6))}


def test_documents_stops_and_frontier_and_leak_statistics():
    """Each document the challenger read is in the audit trail; compact tasks stop at </answer> and
    the reasoner at selfplay.reasoner_stop; the frontier share counts tasks with 0 < pass rate < 1 and
    the leak rate tasks whose answer stands in the question."""
    specs = []

    class Recording(ScriptedModel):
        def __call__(self, prompts, sampling):
            specs.append(sampling)
            return super().__call__(prompts, sampling)

        def _one(self, prompt, sampling, j):
            if sampling.role == "challenger" and "SPEC[leak]" in prompt:
                return Completion(task_text("There are 42 here. How many? K=8", "integer", "42"), [1, 2])
            return super()._one(prompt, sampling, j)

    docs = [doc(0, "SPEC[k4]"), doc(1, "SPEC[leak]"), doc(2, "SPEC[k0]")]
    cfg = SelfPlayConfig(batch_docs=3, group_size=8, attempts_per_round=1, protocol="compact",
                         challenger_group="single", reasoner_stop=["\nQ:"])
    result = run_iteration(docs, Recording(), _verifier(), cfg, random.Random(0), rollout_version=2, iteration=4)
    documents = [r for r in result.records if r["kind"] == "document"]
    assert [(r["doc_id"], r["text"], r["iteration"], r["rollout_version"]) for r in documents] == \
        [(d.doc_id, d.text, 4, 2) for d in docs]
    assert {s.stop for s in specs if s.role == "challenger"} == {("</answer>",)}
    assert {s.stop for s in specs if s.role == "reasoner"} == {("\nQ:",)}
    s = result.stats
    assert s["challenger/frontier_share"] == pytest.approx(1 / 3)  # k4: 4 of 8; leak: 8 of 8; k0: 0 of 8
    assert s["challenger/leak_rate"] == pytest.approx(1 / 3)


def test_mcq_answer_marked_in_an_option_is_an_invalid_attempt_and_counted():
    result, _ = run([doc(0, "SPEC[mcqleak]"), doc(1, "SPEC[k4]")], max_attempts=4)
    s = result.stats
    assert s["invalid/answer_in_options"] == pytest.approx(4 / 8)  # all 4 attempts of doc 0, of 8 in all
    assert s["valid_task_rate"] == 0.5 and s["challenger/leak_rate"] == 0.0


def test_a_document_too_long_for_the_context_is_a_counted_skip_and_a_long_question_an_invalid_attempt(
        qwen3_tokenizer, caplog):
    """D5: an over-long prompt is never a request vLLM rejects (a stopped run) or truncates."""
    cfg = SelfPlayConfig(batch_docs=2, group_size=8, attempts_per_round=4, max_attempts=4, protocol="compact",
                         challenger_group="single", challenger_max_tokens=256, reasoner_max_tokens=64)
    text = "SPEC[k4] " + "word " * 900
    tokens = len(qwen3_tokenizer(text, add_special_tokens=False)["input_ids"])  # as the corpus counts them
    long_doc = Document("src/1/0", text, "src", 1, 0, "sha1", tokens)
    with caplog.at_level("WARNING"):
        result = run_iteration([doc(0, "SPEC[k4]"), long_doc], ScriptedModel(), _verifier(), cfg, random.Random(0),
                               tokenizer=qwen3_tokenizer, max_model_len=1024)
    s = result.stats
    assert s["skipped/prompt_too_long"] == 1.0 and s["valid_task_rate"] == 1.0
    assert "skipping document src/1/0: prompt_too_long" in caplog.text
    skipped = [r for r in result.records if r["kind"] == "document" and r.get("skipped")]
    assert [r["doc_id"] for r in skipped] == ["src/1/0"]
    assert all(r["doc_id"] == "src/0/0" for r in result.records if r["kind"] != "document")
    # the reasoner's request: its question + reasoner_max_tokens must fit too
    tight = SelfPlayConfig(**{**cfg.__dict__, "reasoner_max_tokens": 1000})
    result = run_iteration([doc(0, "SPEC[k4]")], ScriptedModel(), _verifier(), tight, random.Random(0),
                           tokenizer=qwen3_tokenizer, max_model_len=1024)
    assert result.stats["invalid/question_over_context"] == 1.0 and result.stats["valid_task_rate"] == 0.0
    # with the caller's tokenisation (the driver's per-iteration cache), a reasoner prompt measured
    # here is tokenised once, by that cache, and sent from it
    cache: dict[str, list[int]] = {}

    def token_ids(prompt):
        if prompt not in cache:
            cache[prompt] = prompt_token_ids(prompt, qwen3_tokenizer)
        return cache[prompt]

    sent = []

    def generate(prompts, spec):
        if spec.role == "reasoner":
            sent.extend(prompts)
        return ScriptedModel()(prompts, spec)

    result = run_iteration([doc(0, "SPEC[k4]")], generate, _verifier(), cfg, random.Random(0),
                           tokenizer=qwen3_tokenizer, max_model_len=1024, token_ids=token_ids)
    assert result.stats["valid_task_rate"] == 1.0 and sent and all(p in cache for p in sent)


def test_start_up_refuses_a_context_that_cannot_hold_the_longest_document(qwen3_tokenizer, tmp_path):
    from recipes import get_recipe
    from spice_megatron.config import ConfigError
    from spice_megatron.selfplay.context_budget import check_context_budget

    cfg = get_recipe("qwen3_8b")
    check_context_budget(cfg, qwen3_tokenizer)  # the paper recipe holds its documents with the built-in prompts
    published = tmp_path / "prompts"  # a prompt the size of the paper's published free-form prompt (~2.2k tokens)
    published.mkdir()
    (published / "generate_free_form.txt").write_text("Step by step, write a hard question. " * 280 + "{document}")
    cfg.selfplay.prompt_dir = str(published)
    check_context_budget(cfg, qwen3_tokenizer)
    (published / "generate_free_form.txt").write_text("Step by step, write a hard question. " * 600 + "{document}")
    with pytest.raises(ConfigError, match=r"rollout.max_model_len=12288 cannot hold the challenger's longest request: "
                                          r"the integer generation prompt \(the files in selfplay.prompt_dir=.*\) is "
                                          r"\d+ tokens \+ a document of up to corpus.max_doc_tokens=5992 \+ "
                                          r"selfplay.challenger_max_tokens=2048 = \d+ tokens"):
        check_context_budget(cfg, qwen3_tokenizer)


def test_a_fixed_challenger_writes_in_its_own_template_and_the_reasoner_in_the_policys():
    seen = {}

    def fixed(prompts, sampling):
        seen["challenger"] = prompts[0]
        return [[Completion(task_text("How many things are there here? K=4", "integer", "42"), [1])] * sampling.n
                for _ in prompts]

    def policy(prompts, sampling):
        seen["reasoner"] = prompts[0]
        return ScriptedModel()(prompts, sampling)

    cfg = SelfPlayConfig(batch_docs=1, group_size=8, attempts_per_round=8, protocol="compact", template="qwen3",
                         challenger="model", challenger_model="m", challenger_template="qwen3_nothink")
    result = run_iteration([doc(0, "SPEC[k4]")], policy, _verifier(), cfg, random.Random(0), challenger_generate=fixed)
    assert seen["challenger"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert seen["reasoner"].endswith("<|im_start|>assistant\n") and result.stats["valid_task_rate"] == 1.0


def test_the_context_budget_is_checked_once_per_setting_across_the_cli_and_its_ranks(qwen3_tokenizer, monkeypatch):
    """The CLI checks before torchrun; the ranks it starts inherit the mark and do not check again."""
    from recipes import get_recipe
    from spice_megatron.selfplay import context_budget

    monkeypatch.delenv(context_budget.CHECKED_ENV, raising=False)
    cfg = get_recipe("qwen3_8b")
    assert context_budget.check_context_budget_once(cfg, qwen3_tokenizer) is True
    assert context_budget.check_context_budget_once(cfg, qwen3_tokenizer) is False  # rank 0 of that run
    cfg.rollout.max_model_len = 16384  # other settings: checked again
    assert context_budget.check_context_budget_once(cfg, qwen3_tokenizer) is True


@pytest.mark.parametrize("protocol", ["compact", "paper"])
def test_ungrounded_self_play_never_shows_the_document_and_says_so(protocol):
    """selfplay.grounding=none (the paper's corpus ablation): every challenger prompt lacks the
    document section and the document's text; the rest of the iteration is unchanged."""
    seen = []

    def generate(prompts, spec):
        seen.extend((spec.role, p) for p in prompts)
        if spec.role == "challenger" and "suitable_for_mcq" in prompts[0]:  # the paper protocol's selection
            return [[Completion('{"suitable_for_mcq": false, "suitable_for_free_form": true, '
                                '"best_answer_type": "Integer"}', [1])] * spec.n for _ in prompts]
        if spec.role == "challenger":
            body = ('{"question": "How many things are there here? K=4", "answer": "42", "answer_type": "Integer"}'
                    if protocol == "paper" else task_text("How many things are there here? K=4", "integer", "42"))
            return [[Completion(body, [1, 2])] * spec.n for _ in prompts]
        return [[Completion(f"\\boxed{{{'42' if j < 4 else '7'}}}", [5]) for j in range(spec.n)] for _ in prompts]

    cfg = SelfPlayConfig(batch_docs=2, group_size=8, attempts_per_round=2, protocol=protocol, grounding="none")
    result = run_iteration([doc(0, "THE SECRET DOCUMENT ZX81"), doc(1, "ANOTHER SECRET QQ42")], generate, _verifier(),
                           cfg, random.Random(0), iteration=1)
    challenger_prompts = [p for role, p in seen if role == "challenger"]
    assert challenger_prompts and not any("SECRET" in p or "{document}" in p or "DOCUMENT BEGIN" in p
                                          for p in challenger_prompts)
    assert result.stats["valid_task_rate"] == 1.0 and result.stats["reasoner/pass_rate"] == pytest.approx(0.5)
    docs = [r for r in result.records if r["kind"] == "document"]
    assert len(docs) == 2 and all(r["shown"] is False for r in docs)  # drawn (the schedule), never shown
    assert all(r["grounded"] is False for r in result.records if r["kind"] == "challenger")
    grounded = run_iteration([doc(0, "THE SECRET DOCUMENT ZX81")], generate, _verifier(),
                             SelfPlayConfig(batch_docs=1, group_size=8, attempts_per_round=2, protocol=protocol),
                             random.Random(0))
    assert any("ZX81" in p for role, p in seen[len(challenger_prompts):] if role == "challenger")
    assert all(r["grounded"] for r in grounded.records if r["kind"] == "challenger")


# ----------------------------------------------------------------------------- phased and streamed schedules

class SeededModel:
    """A stand-in LLM whose every sample is a function of its prompt and its sampling seed only (as
    vLLM's seeded sampling is), answering after a random delay so that streamed requests come back
    in a shuffled order. A document `ODDS[p]` writes a valid task with probability p per sample."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.requests = delay, []
        self.jitter = random.Random(7)

    def __call__(self, prompts, spec: SamplingSpec):
        import time

        self.requests.append((spec.role, len(prompts)))
        if self.delay:
            time.sleep(self.delay * self.jitter.random())
        return [[self._one(p, spec, spec.prompt_seed(i) + k) for k in range(spec.n)] for i, p in enumerate(prompts)]

    @staticmethod
    def _one(prompt, spec, seed):
        draw = random.Random(f"{prompt}|{seed}").random()
        if spec.role == "challenger":
            if "suitable_for_mcq" in prompt:  # the paper protocol's selection: valid most of the time
                return Completion('{"suitable_for_mcq": false, "suitable_for_free_form": true, '
                                  '"best_answer_type": "Integer"}' if draw < 0.8 else "no", [1, 2])
            odds = float(re.search(r"ODDS\[([\d.]+)\]", prompt).group(1))
            if draw >= odds:
                return Completion("I cannot write a task.", [1, 2, 3])
            q = f"How many things here? K={int(draw * 100) % 9} #{seed % 1000}"
            if "```json" in prompt or "JSON" in prompt and "suitable" not in prompt:
                body = json.dumps({"question": q, "answer": "42", "answer_type": "Integer"})
                return Completion("```json\n" + body + "\n```", [7] * 4)
            return Completion(task_text(q, "integer", "42"), [1, 2, 3, 4])
        k = int(re.search(r"K=(\d)", prompt).group(1))
        return Completion(f"so \\boxed{{{'42' if draw * 9 < k else '7'}}}", [5] * (3 + seed % 4))


def _outcome(result):
    """What an iteration produced, without when its requests ran."""
    records = [{k: v for k, v in r.items() if k != "request_s"} for r in result.records]
    samples = [(s.role, s.prompt, s.completion.text, s.reward, round(s.advantage, 12), s.group, s.doc_id)
               for s in result.samples]
    stats = {k: v for k, v in result.stats.items() if not k.startswith("time/")}
    return records, samples, stats


@pytest.mark.parametrize("protocol,group", [("compact", "single"), ("compact", "document"), ("paper", "document")])
def test_the_streamed_schedule_gives_the_phased_outcome_whatever_the_order_requests_finish(protocol, group):
    docs = [doc(i, f"ODDS[{p}]") for i, p in enumerate([0.9, 0.3, 0.1, 0.02, 0.6, 0.0])]
    cfg = SelfPlayConfig(batch_docs=len(docs), group_size=4, attempts_per_round=2, max_attempts=8,
                         protocol=protocol, challenger_group=group)
    phased_model, streamed_model = SeededModel(), SeededModel(delay=0.02)
    phased = run_iteration(docs, phased_model, _verifier(), cfg, random.Random(3), seed=11)
    streamed = run_iteration(docs, streamed_model, _verifier(), cfg, random.Random(3), seed=11, streamed=True)
    assert _outcome(streamed) == _outcome(phased)
    # documents needed different numbers of rounds, and the streamed schedule asked per document
    rounds = Counter(r["doc_id"] for r in phased.records if r["kind"] == "challenger")
    assert len(set(rounds.values())) > 1
    with_task = len({r["doc_id"] for r in phased.records if r["kind"] == "reasoner"})
    assert len([1 for role, _ in streamed_model.requests if role == "reasoner"]) == with_task > 1
    assert len([1 for role, _ in phased_model.requests if role == "reasoner"]) == 1
    # every record says when its request ran: submitted before it finished, within the iteration
    spans = [r["request_s"] for r in streamed.records if r["kind"] in ("challenger", "reasoner")]
    assert spans and all(0 <= a <= b for a, b in spans)
    # another seed samples otherwise
    other = run_iteration(docs, SeededModel(), _verifier(), cfg, random.Random(3), seed=12)
    assert _outcome(other)[1] != _outcome(phased)[1]


def test_a_failed_streamed_request_is_raised_once_the_others_are_back():
    from spice_megatron.rollout.fleet import NoEngineLeft

    in_flight, most = [0], [0]
    lock = __import__("threading").Lock()

    def generate(prompts, spec):
        import time

        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            time.sleep(0.05)
            if "ODDS[0.5]" in prompts[0]:
                raise NoEngineLeft("no healthy rollout engine left")
            return SeededModel()(prompts, spec)
        finally:
            with lock:
                in_flight[0] -= 1

    docs = [doc(i, f"ODDS[{p}]") for i, p in enumerate([0.9, 0.5, 0.1, 0.0])]
    cfg = SelfPlayConfig(batch_docs=4, group_size=4, attempts_per_round=2, max_attempts=8, protocol="compact")
    with pytest.raises(NoEngineLeft):
        run_iteration(docs, generate, _verifier(), cfg, random.Random(0), seed=1, streamed=True)
    assert in_flight[0] == 0 and most[0] > 1  # concurrent, and nothing left running
