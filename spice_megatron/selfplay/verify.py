"""Answer equivalence for the reasoner reward.

- multiple choice: the option letter (accepting B, (B), \\boxed{B}, B) text);
- integer / expression: Math-Verify, in worker processes with a hard deadline;
- string: normalised text match. Never Math-Verify: it parses `Paris` as a product of symbols
  and would accept the anagram `Pairs`.

Math-Verify's own timeouts rely on SIGALRM and only work in a process's main thread, and some
inputs (`9^{9^{9^{9}}}`) run C-level big-integer work that ignores signals. So each call runs in a
worker process's main thread, returns a bool only (unpickling sympy results can re-evaluate them),
and the parent kills and replaces a worker that overruns its deadline.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import re
import signal
import string
import threading
import time
import unicodedata
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait

from spice_megatron.tasks import INTEGER_ANSWER, parse_letter
from spice_megatron.torchrun import die_with_parent

log = logging.getLogger(__name__)

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_ARTICLES = ("a", "an", "the")
MAX_ANSWER_CHARS = 2000  # longer predictions are wrong by construction, never parsed


def _worker_main(conn, soft_timeout: int, parent_pid: int) -> None:
    # a kill -9 of the run must not leave a worker computing a huge power for hours
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the trainer decides what it means (finish the
    # iteration) and closes the pool itself, so a worker must neither die nor fail a verdict on it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.disable(logging.WARNING)  # Math-Verify logs every parse failure
    from math_verify import parse, verify

    while True:
        try:
            gold, pred = conn.recv()
        except EOFError:
            return
        try:
            ok = bool(verify(parse(gold, parsing_timeout=soft_timeout), parse(pred, parsing_timeout=soft_timeout),
                             timeout_seconds=soft_timeout))
        except BaseException:  # any failure inside Math-Verify means "not shown equivalent"
            ok = False
        conn.send(ok)


class _Worker:
    def __init__(self, ctx, soft_timeout: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, soft_timeout, os.getpid()), daemon=True,
                                name="spice-math-verify")
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class MathVerifyPool:
    """Math-Verify in worker processes with a per-call deadline; overrunning workers are replaced."""

    def __init__(self, processes: int = 2, soft_timeout: int = 3, hard_timeout: float = 10.0,
                 start_method: str = "spawn"):
        if processes < 1:
            raise ValueError(f"processes: must be >= 1, got {processes}")
        if hard_timeout <= 0:
            raise ValueError(f"hard_timeout: must be > 0, got {hard_timeout}")
        # hard_timeout normally exceeds soft_timeout (Math-Verify's own, signal-based limit), so
        # the kill is the backstop for calls that ignore the signal.
        self.processes, self.soft_timeout, self.hard_timeout = processes, soft_timeout, hard_timeout
        self._ctx = mp.get_context(start_method)  # spawn: the caller may hold threads (vLLM, torch)
        self._workers: list[_Worker] = []
        # workers are started from this one thread, which lives as long as the pool: their
        # parent-death signal follows the starting thread, and a caller's thread may end first
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spice-math-verify-starter")
        self._lock = threading.Lock()
        self.killed = 0  # workers killed for overrunning their deadline

    def _ensure_workers(self) -> None:
        self._workers = [w for w in self._workers if w.proc.is_alive()]
        while len(self._workers) < self.processes:
            self._workers.append(self._starter.submit(_Worker, self._ctx, self.soft_timeout).result())

    def verify_many(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """(gold, prediction) LaTeX pairs -> equivalence; a timed-out or crashed call is False."""
        if not pairs:
            return []
        with self._lock:
            return self._run(pairs)

    def _run(self, pairs: list[tuple[str, str]]) -> list[bool]:
        self._ensure_workers()
        results: list[bool | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        while pending or any(w.task is not None for w in self._workers):
            for w in self._workers:
                if w.task is None and pending:
                    w.task, w.started = pending.popleft(), time.monotonic()
                    w.conn.send(pairs[w.task])
            busy = [w for w in self._workers if w.task is not None]
            next_deadline = min(w.started for w in busy) + self.hard_timeout
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            now = time.monotonic()
            replaced = []
            for w in busy:
                if w.conn in ready:
                    try:
                        results[w.task] = bool(w.conn.recv())
                        w.task = None
                        continue
                    except (EOFError, OSError):  # the worker died mid-call
                        log.warning("math-verify worker died on item %d; counted as not equivalent", w.task)
                elif now - w.started < self.hard_timeout:
                    continue
                else:
                    self.killed += 1
                    log.warning("math-verify call exceeded %.1fs; worker killed and replaced", self.hard_timeout)
                results[w.task] = False
                w.kill()
                replaced.append(w)
            if replaced:
                self._workers = [w for w in self._workers if w not in replaced]
                self._ensure_workers()
        return [bool(r) for r in results]

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                w.kill()
            self._workers = []


# ----------------------------------------------------------------------------- normalisation

def _unwrap(s: str) -> str:
    s = s.strip()
    for _ in range(3):  # nested wrappers such as \text{\textbf{B}}
        s = _TEXT_WRAPPER.sub(r"\1", s)
    s = s.strip().strip("$").strip()
    if s.startswith("\\boxed{") and s.endswith("}"):
        s = s[len("\\boxed{"):-1].strip()
    return s


def normalise_string(s: str) -> str:
    """Case, punctuation, spacing and articles removed. An answer made only of articles keeps
    them: "A", "(A)" and "a" are option letters there ("(A)" is a BBEH target), not an article."""
    s = unicodedata.normalize("NFKC", _unwrap(s)).lower()
    s = "".join(" " if unicodedata.category(c).startswith("P") or c in string.punctuation else c for c in s)
    words = s.split()
    return " ".join([w for w in words if w not in _ARTICLES] or words)


def _as_int(s: str) -> int | None:
    s = _unwrap(s).replace(" ", "")
    if INTEGER_ANSWER.match(s):
        return int(s.replace(",", ""))
    return None


class AnswerVerifier:
    """Routes each (prediction, gold, answer_type) to the right check; math goes to the pool."""

    def __init__(self, processes: int = 2, soft_timeout: int = 3, hard_timeout: float = 10.0):
        self.pool = MathVerifyPool(processes, soft_timeout, hard_timeout)

    def verify_batch(self, items: list[tuple[str | None, str, str]]) -> list[bool]:
        """items: (prediction or None, gold, answer_type) -> is the prediction equivalent."""
        out: list[bool | None] = [None] * len(items)
        math_idx, math_pairs = [], []
        for i, (pred, gold, answer_type) in enumerate(items):
            local = self._local_check(pred, gold, answer_type)
            if local is None:
                math_idx.append(i)
                math_pairs.append((f"\\boxed{{{_unwrap(gold)}}}", f"\\boxed{{{_unwrap(pred)}}}"))
            else:
                out[i] = local
        for i, ok in zip(math_idx, self.pool.verify_many(math_pairs)):
            out[i] = ok
        return [bool(x) for x in out]

    @staticmethod
    def _local_check(pred: str | None, gold: str, answer_type: str) -> bool | None:
        """The answer when no Math-Verify call is needed, else None."""
        if pred is None or not pred.strip() or len(pred) > MAX_ANSWER_CHARS:
            return False
        if answer_type == "multiple_choice":
            letter = parse_letter(_unwrap(pred))
            return letter is not None and letter == parse_letter(gold)
        if answer_type == "string":
            return normalise_string(pred) == normalise_string(gold) != ""
        if answer_type == "integer":
            p, g = _as_int(pred), _as_int(gold)
            if p is not None and g is not None:
                return p == g
            return None
        if answer_type == "expression":
            return None
        raise ValueError(f"answer_type: unknown {answer_type!r}")

    def is_equivalent(self, prediction: str | None, gold: str, answer_type: str) -> bool:
        return self.verify_batch([(prediction, gold, answer_type)])[0]

    def close(self) -> None:
        self.pool.close()


_default: AnswerVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> AnswerVerifier:
    global _default
    with _default_lock:
        if _default is None:
            _default = AnswerVerifier()
            atexit.register(_default.close)
        return _default


def is_equivalent(prediction: str | None, gold: str, answer_type: str) -> bool:
    """Is `prediction` (the reasoner's boxed content) the gold answer of the given type?"""
    return default_verifier().is_equivalent(prediction, gold, answer_type)


def answer_key(prediction: str | None, answer_type: str) -> str | None:
    """A canonical form for counting equal answers (R-Zero's majority vote); None when absent."""
    if prediction is None or not prediction.strip():
        return None
    if answer_type == "multiple_choice":
        return parse_letter(_unwrap(prediction))
    if answer_type == "string":
        return normalise_string(prediction)
    as_int = _as_int(prediction)
    return str(as_int) if as_int is not None else _unwrap(prediction).replace(" ", "")
