import random
import re

import pytest

from spice_megatron.config import SelfPlayConfig
from spice_megatron.corpus import Document
from spice_megatron.rollout.types import Completion, SamplingSpec
from spice_megatron.selfplay import run_iteration


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
                return Completion(task_text("Which metal? K=2", "multiple_choice", "C", ["Tin", "Iron", "Lead", "Zinc"]),
                                  [1, 2])
            k = 4 if spec == "late" else int(spec[1:])
            return Completion(task_text(f"How many things are there here? K={k}", "integer", "42"), [1, 2, 3, 4])
        k = int(re.search(r"K=(\d)", prompt).group(1))
        right = "C" if "Which metal" in prompt else "42"
        return Completion(f"Thinking... \\boxed{{{right if j < k else '7'}}}", [5] * 6)


def run(docs, **cfg):
    cfg = SelfPlayConfig(**{"batch_docs": len(docs), "group_size": 8, "attempts_per_round": 4, **cfg})
    model = ScriptedModel()
    result = run_iteration(docs, model, _verifier(), cfg, random.Random(0), weights_version=3, iteration=5)
    return result, model


_V = None


def _verifier():
    global _V
    if _V is None:
        from spice_megatron.verify import AnswerVerifier
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
    assert s["reasoner_pass_rate"] == pytest.approx((4 + 8 + 2) / 24)
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
    assert all(r["weights_version"] == 3 and r["iteration"] == 5 and r["doc_id"] for r in result.records)
    trained = [r for r in ch if r["trained"]]
    assert len(trained) == 2 and {r["doc_id"] for r in trained} == {"src/0/0", "src/1/0"}
    valid = [r for r in trained if r["valid"]][0]
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
