"""Fixed tasks for `selfplay.challenger=tasks`: a JSONL file of questions with gold answers that
stands in for the challenger (the paper's fixed-challenger baseline with a precomputed task set,
and the learning check).

One record per line: {"id": ..., "question": ..., "answer": ..., "answer_type": ..., "options": [...]}
(answer_type: integer, expression, string or multiple_choice; options only for multiple_choice,
where the answer is the option's letter). A bad record is a counted, logged skip that names its
line and field; the file must yield at least one task. The pool behaves like a corpus for
`DocumentSampler` (uniform, seeded, exact resume): its `documents` are the tasks.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass

from spice_megatron.entry import UserError
from spice_megatron.tasks import ANSWER_LETTERS, ANSWER_TYPES, Task

log = logging.getLogger(__name__)


class TaskPoolError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class PoolTask:
    doc_id: str  # "<file name>/<id>": the provenance id in the audit trail (as a document's)
    task: Task
    line: int


def _record_task(rec: object) -> Task:
    if not isinstance(rec, dict):
        raise TaskPoolError("the record is not a JSON object")
    question, answer, kind = rec.get("question"), rec.get("answer"), rec.get("answer_type")
    if not isinstance(question, str) or not question.strip():
        raise TaskPoolError("field question is missing or empty")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise TaskPoolError("field answer is missing or empty")
    if kind not in ANSWER_TYPES:
        raise TaskPoolError(f"field answer_type is {kind!r}, not one of {ANSWER_TYPES}")
    options = rec.get("options") or []
    if kind == "multiple_choice":
        if not isinstance(options, list) or not 2 <= len(options) <= len(ANSWER_LETTERS):
            raise TaskPoolError("field options must list 2-10 options for multiple_choice")
        if answer.strip().upper() not in ANSWER_LETTERS[:len(options)]:
            raise TaskPoolError(f"field answer {answer!r} is not the letter of an option")
        return Task(question.strip(), answer.strip().upper(), kind, tuple(str(o) for o in options))
    return Task(question.strip(), answer.strip(), kind)


class TaskPool:
    def __init__(self, path: str, max_bytes: int = 1 << 20):
        import os

        self.path = path
        self.documents: list[PoolTask] = []
        self.skipped: Counter = Counter()
        name = os.path.basename(path)
        try:
            f = open(path, "rb")
        except OSError as e:
            raise TaskPoolError(f"selfplay.tasks_file: cannot read {path}: {e}") from e
        with f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    if len(raw) > max_bytes:
                        raise TaskPoolError(f"the line is longer than {max_bytes} bytes")
                    rec = json.loads(raw.decode("utf-8"))
                    task = _record_task(rec)
                except (TaskPoolError, UnicodeDecodeError, json.JSONDecodeError) as e:
                    reason = str(e).split(":")[0] if not isinstance(e, TaskPoolError) else str(e)
                    self.skipped[reason[:80]] += 1
                    if sum(self.skipped.values()) <= 5:
                        log.warning("%s:%d skipped: %s", path, line_no, e)
                    continue
                ident = rec.get("id", line_no)
                self.documents.append(PoolTask(f"{name}/{ident}", task, line_no))
        if self.skipped:
            log.warning("%s: %d record(s) skipped: %s", path, sum(self.skipped.values()), dict(self.skipped))
        if not self.documents:
            raise TaskPoolError(f"selfplay.tasks_file: {path} holds no usable task (skipped: {dict(self.skipped)})")

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for t in self.documents:
            h.update(json.dumps([t.doc_id, t.task.question, t.task.answer, t.task.answer_type]).encode())
        return h.hexdigest()[:16]
