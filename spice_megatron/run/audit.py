"""Reading a run's audit trail (audit.jsonl): every document the challenger read, every challenger
attempt and every reasoner answer, each with its iteration and the version that generated it.

A challenger record's `challenger_record` cross-references (on reasoner records) are indices into
its iteration's records, which the trainer writes contiguously; `iterations` yields them as such
groups so that a task can be shown beside its document and its G answers.

A document's text is written once, with the first record of it (by its sha256): a paper run reads
each document many times, and the text of every reading would make the trail gigabytes. Later
document records carry the id and hash; `with_document_texts` puts the text back for readers.
"""
from __future__ import annotations

from typing import Iterator

from spice_megatron.tasks import Task, answer_in_question


def compact_documents(records: list[dict], written: set[str]) -> list[dict]:
    """The records to write: a document record whose text the trail already holds (its sha256 in
    `written`) loses its text; `written` gains the hashes written now."""
    out = []
    for r in records:
        if r.get("kind") == "document" and "text" in r:
            sha = r.get("doc_sha256")
            if sha in written:
                r = {k: v for k, v in r.items() if k != "text"}
            elif sha:
                written.add(sha)
        out.append(r)
    return out


def written_document_hashes(records: Iterator[dict]) -> set[str]:
    """The hashes of the documents whose text a trail holds (a resumed run goes on from these)."""
    return {r["doc_sha256"] for r in records if r.get("kind") == "document" and "text" in r and r.get("doc_sha256")}


def with_document_texts(records: Iterator[dict]) -> Iterator[dict]:
    """The records with each document record's text, taken from the first record of that document.
    Holds every distinct document's text once while it reads."""
    texts: dict[str, str] = {}
    for r in records:
        if r.get("kind") == "document":
            sha = r.get("doc_sha256")
            if "text" in r:
                texts.setdefault(sha, r["text"])
            elif sha in texts:
                r = {**r, "text": texts[sha]}
        yield r


def counted_from_one(records: Iterator[dict]) -> Iterator[dict]:
    """The records as today's trail writes them: iterations counted from 1, as the metrics count
    them (a trail written before 2026-12-06 counted from 0: its first record says iteration 0, and
    it is read shifted by one), and the generating version named `rollout_version`, as the metric
    (an older trail called it weights_version, the metrics' name for the version after the update)."""
    shift = None
    for r in records:
        if shift is None:
            shift = 1 if r.get("iteration") == 0 else 0
        if "weights_version" in r:
            r = {("rollout_version" if k == "weights_version" else k): v for k, v in r.items()}
        yield {**r, "iteration": r["iteration"] + shift} if shift and isinstance(r.get("iteration"), int) else r


def iterations(records: Iterator[dict]) -> Iterator[list[dict]]:
    """The records grouped by iteration, in the order written (one iteration's records at a time)."""
    group: list[dict] = []
    for r in records:
        if group and r.get("iteration") != group[0].get("iteration"):
            yield group
            group = []
        group.append(r)
    if group:
        yield group


def _number(value: object, sign: str = "") -> str:
    """A reward or an advantage as the task blocks print them (3 decimals), else as it is ('-' when absent)."""
    return f"{value:{sign}.3f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def one_line(r: dict) -> str:
    what = (r.get("task") or {}).get("question") or r.get("reason") or r.get("extracted") or r.get("text")
    return (f"it={r.get('iteration')} v={r.get('rollout_version')} {r.get('kind'):10s} doc={r.get('doc_id')} "
            f"reward={_number(r.get('reward', '-'))} adv={_number(r.get('advantage', '-'), '+')} "
            f":: {str(what)[:100]!r}")


class IterationIndex:
    """One iteration's records, indexed once: each document by its id, each task's answers by the
    index of its challenger record (what `challenger_record` on a reasoner record holds)."""

    def __init__(self, group: list[dict]):
        self.group = group
        self.documents = {d.get("doc_id"): d for d in group if d.get("kind") == "document"}
        self.answers: dict[int, list[dict]] = {}
        for a in group:
            if a.get("kind") == "reasoner":
                self.answers.setdefault(a.get("challenger_record"), []).append(a)


def leaks(r: dict) -> bool:
    """A challenger record's task can be answered by reading its question (or, for an MCQ, an answer
    marker in its stem or options): the statistic `challenger/leak_rate` counts the same."""
    task = r.get("task")
    if not task:
        return False
    return answer_in_question(Task(str(task.get("question", "")), str(task.get("answer", "")),
                                   str(task.get("answer_type", "")), tuple(task.get("options") or ())))


def task_block(index: int, iteration: IterationIndex) -> str:
    """The valid challenger task at `index` with the document it came from and the reasoner's answers."""
    r = iteration.group[index]
    doc = iteration.documents.get(r.get("doc_id"))
    answers = iteration.answers.get(index, [])
    task = r["task"]
    marks = " ".join(f"{a.get('extracted')}{'+' if a.get('correct') else '-'}" for a in answers)
    lines = [f"it={r.get('iteration')} v={r.get('rollout_version')} doc={r.get('doc_id')} "
             f"reward={r.get('reward', 0.0):.3f} adv={r.get('advantage', 0.0):+.3f} "
             f"pass={sum(bool(a.get('correct')) for a in answers)}/{len(answers)}",
             f"  document: {doc['text'] if doc else '(not recorded)'}"
             + ("   (not shown to the challenger: selfplay.grounding=none)" if r.get("grounded") is False else ""),
             f"  question: {task.get('question')}",
             f"  gold:     {task.get('answer')} ({task.get('answer_type')})"
             + ("   LEAK: the answer can be read off the question" if leaks(r) else ""),
             f"  answers:  {marks or '(none)'}"]
    trained = [a for a in answers if a.get("trained")]
    if trained:
        lines.append("  reasoner (trained): " + " ".join(f"{a.get('reward', 0):.0f}/{a.get('advantage', 0):+.2f}"
                                                       for a in trained))
    return "\n".join(lines)
