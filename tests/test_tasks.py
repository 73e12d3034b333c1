import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spice_megatron.selfplay.protocol import ChallengerPrompts
from spice_megatron.selfplay.templates import reasoner_prompt
from spice_megatron.tasks import Task, extract_boxed, parse_challenger_output, parse_letter

MCQ = """Let me extract facts: the tower is 330 m tall ...
<question>Which material was used for the tower's lattice?</question>
<answer_type>multiple_choice</answer_type>
<options>
A) Steel
B) Puddle iron
C) Aluminium
D) Reinforced concrete
</options>
<answer>B</answer>"""


def free(question, answer_type, answer):
    return (f"notes...\n<question>{question}</question>\n<answer_type>{answer_type}</answer_type>\n"
            f"<answer>{answer}</answer>")


def test_parse_multiple_choice():
    r = parse_challenger_output(MCQ)
    assert r.valid and r.reason == ""
    assert r.task == Task("Which material was used for the tower's lattice?", "B", "multiple_choice",
                          ("Steel", "Puddle iron", "Aluminium", "Reinforced concrete"))
    assert r.task.reasoner_text().endswith("D) Reinforced concrete")


def test_mcq_answer_given_as_option_text():
    r = parse_challenger_output(MCQ.replace("<answer>B</answer>", "<answer>puddle iron</answer>"))
    assert r.valid and r.task.answer == "B"


def test_mcq_answer_marker_is_a_leak_in_both_parser_and_statistic():
    from spice_megatron.tasks import answer_in_question

    r = parse_challenger_output(MCQ.replace("D) Reinforced concrete\n", "D) Reinforced concrete\nAnswer: B\n"))
    assert r.valid and r.task.options[-1] == "Reinforced concrete"  # the answer line ends the options
    r = parse_challenger_output(MCQ.replace("D) Reinforced concrete", "D) Reinforced concrete Correct: B"))
    assert r.reason == "answer_in_options"
    assert answer_in_question(Task("Q?", "B", "multiple_choice", ("a", "b", "c", "d Correct: B")))
    # an article after "answer:" is not a letter
    assert not answer_in_question(Task("Which answer: A decrease or a rise?", "B", "multiple_choice", ("a", "b", "c",
                                                                                                       "d")))


@pytest.mark.parametrize("answer_type,answer,gold", [
    ("integer", "1,260", "1,260"),
    ("integer", "$-17$", "-17"),
    ("expression", "\\frac{3}{4}", "\\frac{3}{4}"),
    ("expression", "$\\sqrt{2}+1$", "\\sqrt{2}+1"),
    ("string", "Gustave Eiffel", "Gustave Eiffel"),
    ("Integer", "\\boxed{12}", "12"),
])
def test_parse_free_form(answer_type, answer, gold):
    r = parse_challenger_output(free("A train covers a distance; compute the requested quantity.", answer_type, answer))
    assert r.valid, r.reason
    assert r.task.answer == gold and r.task.answer_type == answer_type.lower()


@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("just some rambling", "no_question"),
    ("<question>What?</question>", "no_answer"),
    (free("What?", "number", "4"), "unknown_answer_type"),
    (MCQ.replace("D) Reinforced concrete\n", ""), "wrong_option_count"),
    (MCQ.replace("D) Reinforced concrete\n", "D) Reinforced concrete\nE) Wood\n"), "wrong_option_count"),
    (MCQ.replace("<answer>B</answer>", "<answer>Wood</answer>"), "answer_not_in_options"),
    (MCQ.replace("<answer>B</answer>", "<answer>E</answer>"), "answer_not_in_options"),
    (MCQ.replace("C) Aluminium", "C) Steel"), "duplicate_options"),
    (free("How many sides?", "integer", "twelve"), "answer_type_mismatch"),
    (free("Name it?", "expression", "the big one"), "answer_type_mismatch"),
    (free("Who built the tower designed by Gustave Eiffel?", "string", "Gustave Eiffel"), "answer_leak"),
    (free("Compute 1260 divided by 1.", "integer", "1260"), "answer_leak"),
    (free("Name?", "string", "a very long answer " * 10), "answer_too_long"),
    ("x" * 40_000, "too_long"),
])
def test_invalid_reasons(text, reason):
    r = parse_challenger_output(text)
    assert not r.valid and r.reason == reason


def test_last_complete_task_wins():
    text = free("First draft?", "integer", "1") + "\nRevised:\n" + free("Final question, harder?", "integer", "2")
    assert parse_challenger_output(text).task.question == "Final question, harder?"


@settings(max_examples=300, deadline=2000)
@given(st.text())
def test_parser_never_raises(text):
    r = parse_challenger_output(text)
    assert r.valid or r.reason


@settings(max_examples=100, deadline=2000)
@given(st.lists(st.sampled_from(["<question>", "</question>", "<answer>", "</answer>", "<options>", "</options>",
                                 "<answer_type>", "</answer_type>", "A) x", "\n", "{", "}", "\\boxed{", "B", "7"]),
                max_size=200))
def test_parser_and_boxed_on_tag_soup(parts):
    text = "".join(parts)
    r = parse_challenger_output(text)
    assert r.valid or r.reason
    extract_boxed(text)


@pytest.mark.parametrize("text", [
    "<question>" * 200_000,
    "{" * 1_000_000,
    "\\boxed{" * 150_000,
    "<question>" + "{" * 500_000 + "</question><answer_type>integer</answer_type><answer>1</answer>",
    "(" * 1_000_000,
])
def test_megabyte_inputs_are_bounded(text):
    t0 = time.monotonic()
    parse_challenger_output(text)
    extract_boxed(text)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\fbox{B}", "B"),
    ("\\boxed{a^{b^{c}}}", "a^{b^{c}}"),
    ("no box here", None),
    ("\\boxed{unbalanced", None),
    ("\\boxed{7} and \\boxed{broken", "7"),
    ("{" * 1000 + "\\boxed{x}", "x"),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@settings(max_examples=200, deadline=2000)
@given(st.text())
def test_extract_boxed_never_raises(text):
    extract_boxed(text)
    extract_boxed("\\boxed{" + text + "}")


def test_parse_letter():
    assert [parse_letter(x) for x in ["B", "(c)", "\\boxed{D}", "A) text", "a", "a cat", "J", "K", "AB"]] == \
        ["B", "C", "D", "A", "A", None, "J", None, None]  # up to J: ten-option benchmarks


def test_prompts(qwen3_tokenizer):
    p = ChallengerPrompts().compact_prompt("The Eiffel Tower is 330 m tall.")
    assert "<document>\nThe Eiffel Tower is 330 m tall.\n</document>" in p and "<question>" in p
    task = Task("Which?", "B", "multiple_choice", ("w", "x", "y", "z"))
    rp = reasoner_prompt(task)
    assert "\\boxed{" in rp and "B) x" in rp and "Eiffel" not in rp and "letter" in rp
    chat = reasoner_prompt(Task("What is 2+2?", "4", "integer"), "chat", qwen3_tokenizer)
    assert chat.startswith("<|im_start|>user") and chat.rstrip().endswith("<|im_start|>assistant")


def test_leak_check_all_rejects_short_answers_that_stand_in_the_question():
    from spice_megatron.tasks import parse_challenger_output

    leaky = ("<question>Over the two days Raj collected 21 apples. How many apples did Raj collect?</question>"
             "<answer_type>integer</answer_type><answer>21</answer>")
    fine = ("<question>Raj collected 15 apples on Monday and 6 on Tuesday. How many in all?</question>"
            "<answer_type>integer</answer_type><answer>21</answer>")
    assert parse_challenger_output(leaky).valid  # the default lets small integers through
    assert parse_challenger_output(leaky, "all").reason == "answer_leak"
    assert parse_challenger_output(fine, "all").valid
    word = "<question>Which colour is the red car?</question><answer_type>string</answer_type><answer>red</answer>"
    assert parse_challenger_output(word).valid and parse_challenger_output(word, "all").reason == "answer_leak"
