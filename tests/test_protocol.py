"""The paper's challenger protocol: selection and JSON generation, parsed robustly."""
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spice_megatron.selfplay.protocol import (
    ChallengerPrompts,
    Selection,
    extract_json_object,
    parse_generation,
    parse_selection,
)

FREE = {"identified_information": "x", "question": "A train covers 120 km in 1.5 h. What is its speed in km/h?",
        "answer": "80", "answer_type": "Integer", "step_by_step_solution": "120/1.5"}
MCQ = {"exam_question": "q", "multiple_choice_question": "Which gas dominates air?\nA) Oxygen\nB) Nitrogen\n"
       "C) Argon\nD) Carbon dioxide", "multiple_choice_correct": "B", "question_difficulty": "Hard"}


@pytest.mark.parametrize("text,expected", [
    ('{"suitable_for_mcq": true, "suitable_for_free_form": false, "best_answer_type": null, "reason": "r"}',
     "multiple_choice"),
    ('I think... {"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": "Expression"}',
     "expression"),
    ('```json\n{"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": "string"}\n```',
     "string"),
    ('{"suitable_for_mcq": true, "suitable_for_free_form": true, "best_answer_type": null}', None),  # both
    ('{"suitable_for_mcq": false, "suitable_for_free_form": false, "best_answer_type": null}', None),  # neither
    ('{"suitable_for_mcq": false, "suitable_for_free_form": true, "best_answer_type": "Number"}', None),
    ('{"suitable_for_mcq": "yes", "suitable_for_free_form": false}', None),  # not a boolean
    ("no json at all", None), ("", None),
])
def test_selection(text, expected):
    r = parse_selection(text)
    assert (r.selection.answer_type if r.selection else None) == expected
    assert bool(r.reason) == (expected is None)


@pytest.mark.parametrize("wrap", [
    lambda j: j,
    lambda j: "Let me think step by step about the {document}. It's \"tricky\".\n" + j,  # preamble with braces/quotes
    lambda j: "```json\n" + j + "\n```\nDone.",
    lambda j: "<think>draft: {\"question\": \"\"}</think>\n" + j,
    lambda j: "\\frac{1}{2 is unbalanced {\n" + j,  # a stray brace leaves the object nested: the line fallback
    lambda j: '{"question": "draft", "answer": ""}\n' + j,  # an earlier draft: the last object wins
])
def test_free_form_generation_tolerates_preambles_and_fences(wrap):
    r = parse_generation(wrap(json.dumps(FREE)), Selection("integer"))
    assert r.valid and r.task.answer == "80" and r.task.answer_type == "integer" and "120 km" in r.task.question


def test_free_form_rules():
    sel = Selection("integer")
    for patch, reason in [({"question": ""}, "no_question"), ({"answer": ""}, "no_answer"),
                          ({"answer": "eighty"}, "answer_type_mismatch"), ({"answer_type": "String"},
                                                                           "answer_type_mismatch"),
                          ({"question": "What is 80?", "answer": "80"}, None)]:
        r = parse_generation(json.dumps({**FREE, **patch}), sel)
        assert r.reason == (reason or "") or (reason is None and r.valid), (patch, r)
    r = parse_generation(json.dumps({**FREE, "answer": "Marie Curie Sklodowska Nobel", "answer_type": "String"}),
                         Selection("string"))
    assert r.reason == "answer_too_long"  # a string answer has at most three words
    r = parse_generation(json.dumps({**FREE, "answer": "$\\frac{3}{4}$", "answer_type": "Expression"}),
                         Selection("expression"))
    assert r.valid and r.task.answer == "\\frac{3}{4}"
    r = parse_generation(json.dumps({k: v for k, v in FREE.items() if k != "answer"}), sel)
    assert r.reason == "no_json"  # a required field is missing: no object qualifies
    r = parse_generation(json.dumps({**FREE, "answer": 80}), sel)  # a JSON number is a plain value too
    assert r.valid and r.task.answer == "80"


def test_latex_backslashes_inside_json_strings():
    raw = '{"question": "Compute \\frac{1}{2} \\times \\theta + \\sqrt{2} \\neq \\beta, caf\\u00e9", ' \
          '"answer": "\\frac{3}{4}", "answer_type": "Expression"}'
    r = parse_generation(raw, Selection("expression"))
    assert r.valid and r.task.question.startswith("Compute \\frac{1}{2} \\times \\theta") and "café" in r.task.question
    assert r.task.answer == "\\frac{3}{4}"


def test_mcq_generation():
    r = parse_generation(json.dumps(MCQ), Selection("multiple_choice"))
    assert r.valid and r.task.answer == "B" and r.task.options == ("Oxygen", "Nitrogen", "Argon", "Carbon dioxide")
    assert r.task.question == "Which gas dominates air?"
    for patch, reason in [({"multiple_choice_question": ""}, "no_question"),
                          ({"multiple_choice_correct": "E"}, "answer_not_in_options"),
                          ({"multiple_choice_question": "Q?\nA) x\nB) y\nC) z"}, "wrong_option_count"),
                          ({"multiple_choice_question": "Q?\nA) x\nB) x\nC) z\nD) w"}, "duplicate_options"),
                          ({"multiple_choice_question": "A) x\nB) y\nC) z\nD) w"}, "no_question")]:
        assert parse_generation(json.dumps({**MCQ, **patch}), Selection("multiple_choice")).reason == reason, patch


def test_mcq_answer_line_ends_the_options_and_a_marked_option_is_invalid():
    """D3: the paper's own MCQ format ends with "Correct: [Letter]", which used to be glued onto D."""
    paper_format = "Which gas dominates air?\nA) Oxygen\nB) Nitrogen\nC) Argon\nD) Carbon dioxide\nCorrect: B"
    r = parse_generation(json.dumps({**MCQ, "multiple_choice_question": paper_format}), Selection("multiple_choice"))
    assert r.valid and r.task.options == ("Oxygen", "Nitrogen", "Argon", "Carbon dioxide")
    assert "Correct" not in r.task.reasoner_text()
    for glued in ("D) Carbon dioxide Correct: B", "D) Carbon dioxide (Answer: B)", "D) Carbon dioxide **Answer:** B."):
        block = paper_format.rsplit("\n", 2)[0] + "\n" + glued
        r = parse_generation(json.dumps({**MCQ, "multiple_choice_question": block}), Selection("multiple_choice"))
        assert r.reason == "answer_in_options", glued


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parsers_never_raise(text):
    parse_selection(text)
    for kind in ("multiple_choice", "integer", "expression", "string"):
        parse_generation(text, Selection(kind))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(['{', '}', '"', '\\', '"question": ', '"answer": ', '"answer_type": "Integer"',
                                 ', ', '"42"', '```json', '```', '</think>', '\n', '[', ']', 'x', '\\frac']),
                max_size=60))
def test_parsers_never_raise_on_json_shaped_noise(parts):
    text = "".join(parts)
    assert parse_generation(text, Selection("integer")).valid in (True, False)
    extract_json_object(text, ("question",))


@pytest.mark.parametrize("make", [
    lambda n: "{" * n,  # never closes
    lambda n: "{}" * (n // 2),  # many tiny objects
    lambda n: '{"a": "' + "\\" * (n - 10) + '"}',  # one long string of backslashes
    lambda n: '{"question": ' + "[" * (n // 2) + "]" * (n // 2) + "}",  # deep nesting
    lambda n: "x" * n,
])
def test_linear_time_on_large_adversarial_inputs(make):
    # within the output cap (32k characters) the work is linear; beyond it the output is refused at once
    for n in (8_000, 32_000):
        t0 = time.perf_counter()
        extract_json_object(make(n), ("question",))
        parse_generation(make(n), Selection("integer"))
        elapsed = time.perf_counter() - t0
        assert elapsed < 1.0, (n, elapsed)
    t0 = time.perf_counter()
    assert parse_generation(make(1_000_000), Selection("integer")).reason in ("no_json", "too_long")
    assert time.perf_counter() - t0 < 0.5


def test_prompts_carry_the_document_and_the_type():
    p = ChallengerPrompts("octothinker")
    sel = p.selection_prompt("DOC TEXT")
    assert sel.startswith("A conversation between User and Assistant.") and "DOC TEXT" in sel
    assert sel.rstrip().endswith("Assistant:") and "suitable_for_free_form" in sel
    gen = p.generation_prompt("DOC TEXT", Selection("expression"))
    assert "=== DOCUMENT BEGIN ===\nDOC TEXT\n=== DOCUMENT END ===" in gen and '"answer_type": "Expression"' in gen
    assert "multiple_choice_correct" in p.generation_prompt("D", Selection("multiple_choice"))


def test_no_task_is_taken_from_an_unfinished_think_block():
    """D2: a thinking model cut off at its budget leaves a draft JSON inside <think>; it is not the task."""
    draft = '<think>Maybe {"question": "How many?", "answer": "42", "answer_type": "Integer"} but let me check'
    assert parse_generation(draft, Selection("integer")).reason == "unfinished_think"
    assert parse_generation(draft + "</think>\nno json after", Selection("integer")).reason == "no_json"
    done = draft + '</think>\n{"question": "How many rows?", "answer": "42", "answer_type": "Integer"}'
    assert parse_generation(done, Selection("integer")).valid
    sel = '<think>{"suitable_for_mcq": true, "suitable_for_free_form": false}'
    assert parse_selection(sel).reason == "selection_unfinished_think"
    from spice_megatron.tasks import parse_challenger_output

    compact = "<think><question>How many rows?</question><answer_type>integer</answer_type><answer>42</answer>"
    assert parse_challenger_output(compact).reason == "unfinished_think"


def test_compact_generation_stops_at_the_last_tag_of_the_prompts_examples(tmp_path):
    """A few-shot file that writes <answer> first must not stop the task before its question."""
    assert ChallengerPrompts().compact_stop == "</answer>"
    (tmp_path / "challenger_compact.txt").write_text(
        "Story: Ann had 3 pens and got 4 more. Now she has 7.\n<answer>7</answer>\n<answer_type>integer</answer_type>\n"
        "<question>Ann had 3 pens and got 4 more. How many now?</question>\n\nStory: {document}\n")
    prompts = ChallengerPrompts(prompt_dir=str(tmp_path))
    assert prompts.compact_stop == "</question>"
    story = ChallengerPrompts(prompt_dir="spice_megatron/prompts/stories")
    assert story.compact_stop == "</question>"
    # tags the model writes about the document after {document} do not count
    (tmp_path / "challenger_compact.txt").write_text("Write a task.\n{document}\n<answer></answer>")
    assert ChallengerPrompts(prompt_dir=str(tmp_path)).compact_stop == "</answer>"
