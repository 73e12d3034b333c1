"""Tasks, the compact challenger protocol and the reasoner's answers.

The compact protocol: the challenger writes its task in tagged sections (<question>,
<answer_type>, <options>, <answer>) after free-form working notes; tags parse reliably from small
base and instruct models alike. The paper's JSON protocol is in `selfplay/protocol.py`, the conversation
templates and the reasoner's prompt in `selfplay/templates.py`. Parsers never raise and run in linear time
on any text. The reasoner sees only the question and ends with \\boxed{answer}.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

ANSWER_TYPES = ("multiple_choice", "integer", "expression", "string")
# why a challenger output is not a valid task (ParseResult.reason): metrics name each, every iteration
INVALID_REASONS = ("empty", "too_long", "unfinished_think", "no_json", "parser_error", "no_question", "no_answer",
                   "unknown_answer_type", "answer_type_mismatch", "wrong_option_count", "duplicate_options",
                   "answer_not_in_options", "answer_in_options", "answer_too_long", "question_too_long",
                   "answer_leak", "question_over_context")
OPTION_LETTERS = ("A", "B", "C", "D")  # a challenger's multiple-choice task has exactly four options
ANSWER_LETTERS = "ABCDEFGHIJ"  # benchmarks such as MMLU-Pro and SuperGPQA have up to ten
MAX_OUTPUT_CHARS = 32_000  # longer challenger outputs are rejected before any parsing
MAX_QUESTION_CHARS = 4_000
MAX_STRING_ANSWER_CHARS = 100
MAX_STRING_ANSWER_WORDS = 12
MAX_EXPRESSION_CHARS = 200
COMPACT_END = "</answer>"  # the compact task's last tag: generation stops there

CHALLENGER_INSTRUCTIONS = """\
You are the Challenger. Read the document below and write ONE hard question whose answer is stated in, or can be \
derived from, the document.

Work in steps before writing the task:
1. Extract several facts, quantities or relations from the document that can be combined.
2. Compose a question that needs multi-step reasoning over them; make it harder than a lookup.
3. Self-test: the question must be answerable WITHOUT the document by a strong solver (state every number, \
definition and condition it needs) and must have exactly one correct answer.
4. Never copy the answer into the question.

Choose the format that suits the document:
- multiple_choice: exactly four options A, B, C, D, exactly one correct; the answer is its letter.
- integer: the answer is a single integer.
- expression: the answer is a mathematical expression in LaTeX (a fraction, a radical, an interval, ...).
- string: the answer is a short phrase (at most a few words).

End your output with the task in exactly this format:
<question>the full question, self-contained</question>
<answer_type>multiple_choice | integer | expression | string</answer_type>
<options>
A) ...
B) ...
C) ...
D) ...
</options>
<answer>the gold answer only</answer>
Omit <options> unless the answer_type is multiple_choice.
"""

@dataclass(frozen=True)
class Task:
    question: str
    answer: str
    answer_type: str
    options: tuple[str, ...] = ()

    def reasoner_text(self) -> str:
        """The question as the reasoner sees it (options included, document never)."""
        if self.answer_type != "multiple_choice":
            return self.question
        opts = "\n".join(f"{letter}) {text}" for letter, text in zip(ANSWER_LETTERS, self.options))
        return f"{self.question}\n\n{opts}"


@dataclass(frozen=True)
class ParseResult:
    task: Task | None
    reason: str = ""  # why the output is not a valid task; empty when valid
    details: dict = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.task is not None


# ----------------------------------------------------------------------------- parsing

def _last_tag(text: str, tag: str) -> str | None:
    """Content of the last complete <tag>...</tag>; linear time (rfind, never a backtracking regex)."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    open_ = text.rfind(f"<{tag}>", 0, close)
    if open_ < 0:
        return None
    return text[open_ + len(tag) + 2:close].strip()


_OPTION_LINE = re.compile(r"^\s*\(?([A-Za-z])\s*[).:]\s*(.*)$")
_LETTER = re.compile(r"^\s*(?:\\boxed\{\s*)?\(?\s*([A-Ja-j])\s*\)?\s*\}?\s*(?:[).:]\s*.*)?$", re.S)
INTEGER_ANSWER = re.compile(r"^[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)$")
_MATH_CHARS = re.compile(r"[0-9\\^_=+\-*/()\[\]{}<>]")


def _strip_math_delims(s: str) -> str:
    s = s.strip()
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            return s[len(a):len(s) - len(b)].strip()
    return s


# The paper's MCQ format ends its block with "Correct: [Letter]"; models add "Answer: B" lines too.
# Such a line ends the options (it would otherwise be glued onto option D, where the reasoner reads it).
_ANSWER_LINE = re.compile(r"^\W*(?:the\s+)?(?:correct(?:\s+(?:answer|option|choice))?|answer)\s*(?:is)?\W*[:：=]", re.I)
# An answer marker with its letter at the end of a text: "... Correct: B", "Answer: (C)."
_ANSWER_MARK = re.compile(r"\b(?:correct|answer)(?:\s+(?:answer|option|choice))?\s*(?:is)?[\s*_]*[:：=][\s*_]*"
                          r"\(?[A-D]\)?[.*_]*\s*$", re.I | re.M)


def _parse_options(block: str) -> list[tuple[str, str]]:
    options = []
    for line in block.splitlines():
        if options and _ANSWER_LINE.match(line):
            break
        m = _OPTION_LINE.match(line)
        if m and m.group(2).strip():
            options.append((m.group(1).upper(), m.group(2).strip()))
        elif line.strip() and options:  # a wrapped option continues on the next line
            options[-1] = (options[-1][0], options[-1][1] + " " + line.strip())
    return options


def parse_letter(text: str) -> str | None:
    """A single option letter from 'B', '(B)', '\\boxed{B}', 'B) text'; None otherwise."""
    if len(text) > 2000:
        return None
    m = _LETTER.match(text)
    if not m:
        return None
    letter = m.group(1)
    # A lowercase letter only when it stands alone: 'a' in 'a) ...' is still fine, an article is not.
    if letter.islower() and text.strip().strip("()").strip() != letter:
        return None
    return letter.upper()


def _normalise_for_leak(s: str) -> str:
    return re.sub(r"\s+", " ", s.lower()).strip()


def _leaks(question: str, answer: str, answer_type: str, leak_check: str = "long") -> bool:
    """The validity rule. "long" (the default): short answers (integers under 3 digits, strings under
    4 characters) occur naturally in questions and are let through. "all": any answer that stands
    in the question, for domains where short answers are the rule (the CPU demo's stories, where a
    challenger that copies the story's last sentence into its question hands the reasoner the
    answer, and the two learn to agree on it)."""
    if leak_check == "all":
        return answer_in_question(Task(question, answer, answer_type))
    if answer_type == "integer" and len(answer.replace(",", "").lstrip("+-")) < 3:
        return False
    if answer_type != "integer" and len(_normalise_for_leak(answer)) < 4:
        return False
    return answer_in_question(Task(question, answer, answer_type))


def answer_in_question(task: Task) -> bool:
    """The gold answer can be read off the question: the statistic behind `challenger/leak_rate`. Wider
    than the validity rule `_leaks`, which lets small integers through because they occur naturally."""
    if task.answer_type == "multiple_choice":
        return mcq_answer_marked(task.question, task.options)
    if task.answer_type == "integer":
        number = task.answer.replace(",", "").lstrip("+")
        return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", task.question.replace(",", "")) is not None
    answer = _normalise_for_leak(task.answer)
    return bool(answer) and answer in _normalise_for_leak(task.question)


def mcq_answer_marked(stem: str, options: tuple[str, ...] | list[str]) -> bool:
    """An MCQ whose stem or an option ends with an answer marker ("D) 4 Correct: B"): the reasoner
    would read its answer there. Such tasks are invalid (`answer_in_options`)."""
    return any(_ANSWER_MARK.search(text) for text in (stem, *options))


def parse_challenger_output(text: str, leak_check: str = "long") -> ParseResult:
    """Challenger output -> a valid Task, or an invalid result with the reason. Never raises."""
    try:
        return _parse(text, leak_check)
    except Exception as e:  # defensive: a parser bug must cost one task, not the run
        return ParseResult(None, "parser_error", {"error": f"{type(e).__name__}: {e}"})


def unfinished_think(text: str) -> bool:
    """The output opens a <think> block it never closes (cut off at its token budget): whatever task
    stands in it is a draft, never an answer."""
    opened = text.rfind("<think>")
    return opened >= 0 and text.find("</think>", opened) < 0


def _parse(text: str, leak_check: str) -> ParseResult:
    if not isinstance(text, str) or not text.strip():
        return ParseResult(None, "empty")
    if len(text) > MAX_OUTPUT_CHARS:
        return ParseResult(None, "too_long", {"chars": len(text)})
    if unfinished_think(text):
        return ParseResult(None, "unfinished_think")
    question = _last_tag(text, "question")
    if not question:
        return ParseResult(None, "no_question")
    if len(question) > MAX_QUESTION_CHARS:
        return ParseResult(None, "question_too_long", {"chars": len(question)})
    answer = _last_tag(text, "answer")
    if not answer:
        return ParseResult(None, "no_answer")
    answer_type = (_last_tag(text, "answer_type") or "").strip().lower().replace(" ", "_").replace("-", "_")
    if answer_type in ("mcq", "multiple_choice_question", "multiplechoice"):
        answer_type = "multiple_choice"
    if answer_type not in ANSWER_TYPES:
        return ParseResult(None, "unknown_answer_type", {"answer_type": answer_type[:50]})

    if answer_type == "multiple_choice":
        block = _last_tag(text, "options")
        options = _parse_options(block) if block else []
        if [letter for letter, _ in options] != list(OPTION_LETTERS):
            return ParseResult(None, "wrong_option_count", {"letters": [x for x, _ in options][:10]})
        texts = [t for _, t in options]
        if len({t.lower() for t in texts}) != 4:
            return ParseResult(None, "duplicate_options")
        if mcq_answer_marked(question, texts):
            return ParseResult(None, "answer_in_options")
        letter = parse_letter(answer)
        if letter is not None and letter not in OPTION_LETTERS:
            return ParseResult(None, "answer_not_in_options", {"answer": answer[:100]})
        if letter is None:
            # The gold may be written as the option's text instead of its letter.
            matches = [x for x, t in options if t.strip().lower() == answer.strip().lower()]
            if len(matches) != 1:
                return ParseResult(None, "answer_not_in_options", {"answer": answer[:100]})
            letter = matches[0]
        return ParseResult(Task(question, letter, answer_type, tuple(texts)))

    return free_form_task(question, answer, answer_type, MAX_STRING_ANSWER_WORDS, leak_check)


def free_form_task(question: str, answer: str, answer_type: str, max_string_words: int,
                   leak_check: str = "long") -> ParseResult:
    """A free-form task once its answer matches its type (both protocols' rule): an integer, an
    expression with mathematics in it, or a short string; the answer must not be in the question."""
    gold = _strip_math_delims(answer)
    if gold.startswith("\\boxed{") and gold.endswith("}"):
        gold = gold[len("\\boxed{"):-1].strip()
    if not gold:
        return ParseResult(None, "no_answer")
    if answer_type == "integer" and not INTEGER_ANSWER.match(gold):
        return ParseResult(None, "answer_type_mismatch", {"answer_type": answer_type, "answer": gold[:100]})
    if answer_type == "expression" and (len(gold) > MAX_EXPRESSION_CHARS or not _MATH_CHARS.search(gold)):
        return ParseResult(None, "answer_type_mismatch", {"answer_type": answer_type, "answer": gold[:100]})
    if answer_type == "string" and (len(gold) > MAX_STRING_ANSWER_CHARS or len(gold.split()) > max_string_words):
        return ParseResult(None, "answer_too_long", {"answer": gold[:100]})
    if _leaks(question, gold, answer_type, leak_check):
        return ParseResult(None, "answer_leak")
    return ParseResult(Task(question, gold, answer_type))


# ----------------------------------------------------------------------------- reasoner answers

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_BRACE = re.compile(r"\\?[{}]")


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} (or \\fbox{...}); None when there is none.

    One pass: a stack matches braces, so deep nesting and megabytes of input cost linear time.
    """
    if not isinstance(text, str):
        return None
    starts = []  # positions just after the opening brace of each box opener
    for opener in _BOX_OPENERS:
        i = text.find(opener)
        while i >= 0:
            starts.append(i + len(opener))
            i = text.find(opener, i + 1)
    if not starts:
        return None
    open_at = {s - 1 for s in starts}  # index of each box's "{"
    stack, closing = [], {}
    for m in _BRACE.finditer(text):
        if m.group(0).startswith("\\"):  # LaTeX \{ and \} are literal braces, not grouping
            continue
        if m.group(0) == "{":
            stack.append(m.start())
        elif stack:
            o = stack.pop()
            if o in open_at:
                closing[o] = m.start()
    for s in sorted(starts, reverse=True):
        if s - 1 in closing:
            return text[s:closing[s - 1]].strip()
    return None
