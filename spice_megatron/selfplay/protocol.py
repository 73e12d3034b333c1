"""How the challenger turns a document into a task: the paper's two-step JSON protocol, or the
compact tagged one.

`paper` (SPICE.md, "The game"; the paper's Appendix E, written here in the project's own words with
the same steps and fields):
  1. selection: the document -> ONE JSON object {suitable_for_mcq, suitable_for_free_form,
     best_answer_type, reason}; exactly one of the two booleans is true, and a free-form choice
     names its answer type (Integer, Expression or String);
  2. generation by the chosen type: the document between begin/end markers, numbered steps
     (extract what needs synthesis, harden, write a self-contained question, aim at Hard / Extra
     Hard, self-test) -> ONE JSON object with the MCQ or the free-form fields.
  The trained challenger trajectory is the generation output (prompt: the generation prompt, which
  carries the chosen type). When the selection itself is invalid there is no generation, and the
  selection output is the trajectory that takes the invalid penalty. Selection outputs that led to
  a generation are not trained: the choice of format is rewarded through the task it produced.
`compact`: one prompt, tagged sections (<question>, <answer_type>, <options>, <answer>); fewer
  tokens, the CPU demo and small models.

Prompt files (`selfplay.prompt_dir`) replace the built-in text to run the published prompts
verbatim: selection.txt ({document}), generate_mcq.txt ({document}), generate_free_form.txt
({document}, {answer_type}), challenger_compact.txt ({document}).

The JSON parser never raises and runs in linear time: one pass finds the top-level objects
(braces counted outside strings, strings tracked inside objects), the last one that decodes and
has the required fields wins; a thinking preamble, a ```json fence and LaTeX backslashes inside
strings are tolerated; the required fields and the answer type are checked strictly.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from spice_megatron.selfplay.templates import conversation, read_prompt_file
from spice_megatron.tasks import (
    CHALLENGER_INSTRUCTIONS,
    COMPACT_END,
    MAX_OUTPUT_CHARS,
    MAX_QUESTION_CHARS,
    OPTION_LETTERS,
    ParseResult,
    Task,
    _parse_options,
    free_form_task,
    mcq_answer_marked,
    parse_challenger_output,
    parse_letter,
    unfinished_think,
)

FREE_FORM_TYPES = {"integer": "integer", "expression": "expression", "string": "string"}
MAX_STRING_WORDS = 3  # the paper's free-form string answers: at most three words

SELECTION_PROMPT = """\
You will design an exam question from the document below. First decide which kind of question it supports.

Document:
{document}

Decide:
- suitable_for_mcq: can the document ground a multiple-choice question with four options, exactly one correct, \
whose wrong options are plausible?
- suitable_for_free_form: can it ground a question whose answer is a single value: an integer, a mathematical \
expression, or a short string of at most three words?
- best_answer_type: for a free-form question, "Integer", "Expression" or "String"; null for multiple choice.
Choose exactly one of the two kinds (set exactly one of the booleans to true).

Answer with ONE JSON object and nothing else:
{"suitable_for_mcq": true or false, "suitable_for_free_form": true or false, \
"best_answer_type": "Integer" | "Expression" | "String" | null, "reason": "one short sentence"}
"""

_GENERATION_STEPS = """\
Work through these steps:
1. Identify information in the document that must be combined or reasoned over; avoid facts that are \
stated once and can simply be looked up.
2. Describe how you will make the question hard: combine several pieces, add a calculation or an \
inference, remove shortcuts.
3. Write a self-contained question: a solver will NOT see the document, so state every number, definition \
and condition it needs, and never write "according to the text" or refer to the document.
4. Aim for the Hard or Extra Hard level.
5. Self-test: solve your own question step by step and check that it has exactly one correct answer.
"""

MCQ_PROMPT = """\
Write one hard multiple-choice question grounded in the document between the markers.

=== DOCUMENT BEGIN ===
{document}
=== DOCUMENT END ===

""" + _GENERATION_STEPS + """\
6. Write four options A) to D), exactly one correct; the wrong options must not be easy to rule out without \
solving the question.

You may think first. Then output ONE JSON object, without markdown fences, with these fields:
{"identified_answer": "...", "answer_quote": ["..."], "hardening_process": "...", "exam_question": "...", \
"correct_answer": "...", "multiple_choice_question": "the question followed by the options A) ... B) ... C) ... \
D) ... on their own lines", "multiple_choice_correct": "one letter A-D", "self_test_solution": "...", \
"knowledge_and_reasoning_steps": "...", "question_difficulty": "Hard or Extra Hard"}
If the document does not support such a question, output the object with an empty multiple_choice_question.
"""

FREE_FORM_PROMPT = """\
Write one hard question with a single {answer_type} answer, grounded in the document between the markers.

=== DOCUMENT BEGIN ===
{document}
=== DOCUMENT END ===

""" + _GENERATION_STEPS + """\
6. The answer must be a plain value of type {answer_type}: an integer, a mathematical expression (LaTeX \
allowed), or a string of at most three words.

You may think first. Then output ONE JSON object, without markdown fences, with these fields:
{"identified_information": "...", "relevant_quotes": ["..."], "hardening_process": "...", \
"question": "exactly one question", "answer": "the plain answer value", "answer_type": "{answer_type}", \
"step_by_step_solution": "...", "intermediate_results": "...", "difficulty_level": "Hard or Extra Hard", \
"difficulty_justification": "...", "solving_time_estimate": "...", "required_concepts": ["..."], \
"potential_errors": ["..."]}
If the document does not support such a question, output the object with an empty question and answer.
"""


@dataclass(frozen=True)
class Selection:
    answer_type: str  # "multiple_choice" or a free-form type (integer, expression, string)
    reason: str = ""


@dataclass(frozen=True)
class SelectionResult:
    selection: Selection | None
    reason: str = ""  # why invalid; empty when valid


# A prompt's document section: the {document} placeholder with the markers around it, if any
# (the built-in prompts' <document> tags, === DOCUMENT BEGIN/END === lines and "Document:" heading).
_DOCUMENT_SECTION = re.compile(r"(<document>\n|=== DOCUMENT BEGIN ===\n|Document:\n)?\{document\}"
                               r"(\n</document>|\n=== DOCUMENT END ===)?\n?")


def without_document(prompt: str) -> str:
    """The prompt with its document section left out (selfplay.grounding=none)."""
    return _DOCUMENT_SECTION.sub("", prompt)


class ChallengerPrompts:
    """The challenger's prompts in a model family's format, from the built-in text or files.
    `grounded=False` (selfplay.grounding=none): every prompt without its document section."""

    def __init__(self, template: str = "plain", tokenizer=None, prompt_dir: str = "", grounded: bool = True):
        self.template, self.tokenizer = template, tokenizer
        self.selection = read_prompt_file(prompt_dir, "selection.txt") or SELECTION_PROMPT
        self.mcq = read_prompt_file(prompt_dir, "generate_mcq.txt") or MCQ_PROMPT
        self.free_form = read_prompt_file(prompt_dir, "generate_free_form.txt") or FREE_FORM_PROMPT
        custom_compact = read_prompt_file(prompt_dir, "challenger_compact.txt")
        self.compact = custom_compact or (CHALLENGER_INSTRUCTIONS + "\n<document>\n{document}\n</document>\n")
        self._compact_notes = custom_compact is None
        self.compact_stop = compact_stop(self.compact)  # the built-in prompt's format block ends in </answer>
        if not grounded:  # the document is never shown: the placeholder and its markers go
            self.selection, self.mcq, self.free_form, self.compact = (
                without_document(p) for p in (self.selection, self.mcq, self.free_form, self.compact))

    def _wrap(self, user: str) -> str:
        return conversation(self.template, user, self.tokenizer)

    def selection_prompt(self, document: str) -> str:
        return self._wrap(self.selection.replace("{document}", document))

    def generation_prompt(self, document: str, selection: Selection) -> str:
        if selection.answer_type == "multiple_choice":
            return self._wrap(self.mcq.replace("{document}", document))
        name = selection.answer_type.capitalize()
        return self._wrap(self.free_form.replace("{document}", document).replace("{answer_type}", name))

    def compact_prompt(self, document: str) -> str:
        prompt = self._wrap(self.compact.replace("{document}", document))
        # base models continue plain text: give them a place to think before the tags
        return prompt + "\nWorking notes:\n" if self.template == "plain" and self._compact_notes else prompt


def compact_stop(prompt: str) -> str:
    """The closing tag that ends a compact task: the last one the prompt's examples write before
    {document}. A few-shot file may order the tags as it likes (the CPU demo's writes <answer> first,
    so that a small model copies the story's result before it rewrites the question), and generation
    must stop after the last of them, not the first."""
    head = prompt.split("{document}", 1)[0]
    tags = re.findall(r"</(question|answer_type|options|answer)>", head)
    return f"</{tags[-1]}>" if tags else COMPACT_END


# ----------------------------------------------------------------------------- JSON extraction

_VALID_ESCAPES = set('"\\/bfnrtu')
# LaTeX commands that begin with a letter JSON would read as an escape (\f, \b, \n, \r, \t): a model
# that writes "\frac" in a JSON string means the command, not a form feed.
_LATEX_WORDS = {
    "frac", "dfrac", "tfrac", "times", "text", "textbf", "textit", "theta", "tau", "tan", "tanh", "to", "top",
    "triangle", "tilde", "beta", "binom", "bar", "boxed", "bmod", "bot", "big", "bigg", "bigl", "bigr", "begin",
    "backslash", "neq", "ne", "nabla", "not", "nu", "notin", "nmid", "right", "rangle", "rho", "rightarrow",
    "rfloor", "rceil", "rm", "forall", "flat", "frown", "ngeq", "nleq",
}


def _fix_backslashes(span: str) -> str:
    """Double the backslashes of LaTeX commands and of escapes JSON does not know, in linear time."""
    out, i, n = [], 0, len(span)
    while i < n:
        c = span[i]
        if c != "\\" or i + 1 >= n:
            out.append(c)
            i += 1
            continue
        nxt = span[i + 1]
        if nxt == "\\":  # an escaped backslash stays as it is
            out.append("\\\\")
            i += 2
            continue
        j = i + 1
        while j < n and span[j].isalpha():
            j += 1
        word = span[i + 1:j]
        unicode_escape = nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", span[i + 2:i + 6]) is not None
        if nxt not in _VALID_ESCAPES or word in _LATEX_WORDS or (nxt == "u" and not unicode_escape):
            out.append("\\\\")
        else:
            out.append("\\")
        i += 1
    return "".join(out)


def _top_level_objects(text: str) -> list[tuple[int, int]]:
    """(start, end) of every top-level {...} in text, in one pass. Quotes count only inside an
    object, so an apostrophe or stray quote in a thinking preamble cannot derail the scan."""
    spans, depth, start, in_str, esc = [], 0, -1, False, False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"' and depth > 0:
            in_str = True
        elif c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append((start, i + 1))
    return spans


def _decode(span: str) -> dict | None:
    for candidate in (span, _fix_backslashes(span)):
        try:
            obj = json.loads(candidate)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def extract_json_object(text: str, required: tuple[str, ...]) -> dict | None:
    """The last JSON object in `text` that decodes and has every `required` key; None otherwise.
    Looks after a closing </think> when there is one, and inside the last ```json fence when the
    text has one; falls back to the last line that starts with "{" when a stray brace in the
    preamble leaves the real object nested."""
    if not isinstance(text, str) or len(text) > MAX_OUTPUT_CHARS:
        return None
    think = text.rfind("</think>")
    if think >= 0:
        text = text[think + len("</think>"):]
    fence = text.rfind("```json")
    if fence >= 0:
        end = text.find("```", fence + 7)
        text = text[fence + 7:end if end >= 0 else len(text)]
    candidates = [text[a:b] for a, b in reversed(_top_level_objects(text))]
    line_start = text.rfind("\n{")
    if line_start >= 0:
        tail = text[line_start + 1:]
        spans = _top_level_objects(tail)
        if spans:
            candidates.append(tail[spans[0][0]:spans[0][1]])
    for span in candidates:
        obj = _decode(span)
        if obj is not None and all(k in obj for k in required):
            return obj
    return None


# ----------------------------------------------------------------------------- validity

def parse_selection(text: str) -> SelectionResult:
    """Selection output -> the chosen type, or the reason it is invalid. Never raises."""
    try:
        if isinstance(text, str) and unfinished_think(text):
            return SelectionResult(None, "selection_unfinished_think")
        obj = extract_json_object(text, ("suitable_for_mcq", "suitable_for_free_form"))
        if obj is None:
            return SelectionResult(None, "selection_no_json")
        mcq, free = obj.get("suitable_for_mcq"), obj.get("suitable_for_free_form")
        if not isinstance(mcq, bool) or not isinstance(free, bool) or mcq == free:
            return SelectionResult(None, "selection_not_exactly_one")
        reason = obj.get("reason") if isinstance(obj.get("reason"), str) else ""
        if mcq:
            return SelectionResult(Selection("multiple_choice", reason[:500]))
        kind = obj.get("best_answer_type")
        kind = FREE_FORM_TYPES.get(kind.strip().lower()) if isinstance(kind, str) else None
        if kind is None:
            return SelectionResult(None, "selection_answer_type")
        return SelectionResult(Selection(kind, reason[:500]))
    except Exception as e:  # noqa: BLE001 - a parser bug costs one attempt, not the run
        return SelectionResult(None, f"parser_error: {type(e).__name__}")


def _as_text(value) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return str(value)
    return value.strip() if isinstance(value, str) else None


def parse_generation(text: str, selection: Selection, leak_check: str = "long") -> ParseResult:
    """Generation output -> a valid Task of the selected type, or an invalid result with its reason."""
    try:
        if isinstance(text, str) and unfinished_think(text):  # a draft JSON inside it is not the task
            return ParseResult(None, "unfinished_think")
        if selection.answer_type == "multiple_choice":
            return _parse_mcq(text)
        return _parse_free_form(text, selection.answer_type, leak_check)
    except Exception as e:  # noqa: BLE001
        return ParseResult(None, "parser_error", {"error": f"{type(e).__name__}: {e}"})


def _parse_mcq(text: str) -> ParseResult:
    obj = extract_json_object(text, ("multiple_choice_question", "multiple_choice_correct"))
    if obj is None:
        return ParseResult(None, "no_json")
    block = _as_text(obj["multiple_choice_question"])
    if not block:
        return ParseResult(None, "no_question")
    if len(block) > MAX_QUESTION_CHARS:
        return ParseResult(None, "question_too_long", {"chars": len(block)})
    lines = block.splitlines()
    first_option = next((i for i, line in enumerate(lines) if re.match(r"^\s*\(?A\s*[).:]", line)), None)
    if first_option is None:
        return ParseResult(None, "wrong_option_count", {"letters": []})
    stem = "\n".join(lines[:first_option]).strip()
    options = _parse_options("\n".join(lines[first_option:]))
    if not stem:
        return ParseResult(None, "no_question")
    if [letter for letter, _ in options] != list(OPTION_LETTERS):
        return ParseResult(None, "wrong_option_count", {"letters": [x for x, _ in options][:10]})
    texts = [t for _, t in options]
    if len({t.lower() for t in texts}) != 4:
        return ParseResult(None, "duplicate_options")
    if mcq_answer_marked(stem, texts):
        return ParseResult(None, "answer_in_options")
    letter = parse_letter(_as_text(obj["multiple_choice_correct"]) or "")
    if letter not in OPTION_LETTERS:
        return ParseResult(None, "answer_not_in_options", {"answer": str(obj["multiple_choice_correct"])[:100]})
    return ParseResult(Task(stem, letter, "multiple_choice", tuple(texts)))


def _parse_free_form(text: str, selected: str, leak_check: str) -> ParseResult:
    obj = extract_json_object(text, ("question", "answer"))
    if obj is None:
        return ParseResult(None, "no_json")
    question, answer = _as_text(obj["question"]), _as_text(obj["answer"])
    if not question:
        return ParseResult(None, "no_question")
    if not answer:
        return ParseResult(None, "no_answer")
    if len(question) > MAX_QUESTION_CHARS:
        return ParseResult(None, "question_too_long", {"chars": len(question)})
    stated = obj.get("answer_type")
    stated = FREE_FORM_TYPES.get(stated.strip().lower()) if isinstance(stated, str) else None
    if stated != selected:
        return ParseResult(None, "answer_type_mismatch", {"selected": selected,
                                                          "stated": str(obj.get("answer_type"))[:50]})
    return free_form_task(question, answer, selected, MAX_STRING_WORDS, leak_check)


__all__ = ["ChallengerPrompts", "Selection", "SelectionResult", "extract_json_object",
           "parse_selection", "parse_generation", "parse_challenger_output"]
