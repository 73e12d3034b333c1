import threading
import time

import pytest

from spice_megatron.selfplay.verify import MathVerifyPool, answer_key, normalise_string


@pytest.mark.parametrize("pred", ["B", "(B)", "\\boxed{B}", "B) the second option", "\\text{B}", " b "])
def test_mcq_letter_forms(verifier, pred):
    assert verifier.is_equivalent(pred, "B", "multiple_choice")


@pytest.mark.parametrize("pred", ["C", "A or B", "Both", "", None])
def test_mcq_wrong(verifier, pred):
    assert not verifier.is_equivalent(pred, "B", "multiple_choice")


@pytest.mark.parametrize("pred,gold,expected", [
    ("Paris", "paris", True),
    ("The Eiffel Tower.", "eiffel tower", True),
    ("\\text{New York}", "New York", True),
    ("Pairs", "Paris", False),  # Math-Verify would call this equal (product of symbols)
    ("York New", "New York", False),
    ("", "Paris", False),
])
def test_strings_by_normalised_text(verifier, pred, gold, expected):
    assert verifier.is_equivalent(pred, gold, "string") is expected


@pytest.mark.parametrize("pred,gold,answer_type,expected", [
    ("42", "42", "integer", True),
    ("1,000", "1000", "integer", True),
    ("42.0", "42", "integer", True),
    ("\\frac{84}{2}", "42", "integer", True),
    ("43", "42", "integer", False),
    ("0.5", "\\frac{1}{2}", "expression", True),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", "expression", True),
    ("(x+1)^2", "x^2+2x+1", "expression", True),
    ("\\{3,2,1\\}", "\\{1,2,3\\}", "expression", True),
    ("[0,1)", "(0,1]", "expression", False),
    ("0.33", "\\frac{1}{3}", "expression", False),
])
def test_math_with_math_verify(verifier, pred, gold, answer_type, expected):
    assert verifier.is_equivalent(pred, gold, answer_type) is expected


def test_pathological_input_is_bounded(verifier):
    t0 = time.monotonic()
    out = verifier.verify_batch([("9^{9^{9^{9}}}", "1", "expression"), ("\\boxed{" * 5000, "1", "expression"),
                                 ("2", "2", "integer"), ("1/2", "0.5", "expression")])
    assert out == [False, False, True, True]
    assert time.monotonic() - t0 < 20


@pytest.mark.multiprocess
def test_hung_worker_is_killed_and_replaced():
    # A soft limit far above the hard deadline: only the parent's kill can end the call.
    pool = MathVerifyPool(processes=1, soft_timeout=60, hard_timeout=2.0)
    try:
        t0 = time.monotonic()
        assert pool.verify_many([("\\boxed{9^{9^{9^{9}}}}", "\\boxed{1}"), ("\\boxed{3}", "\\boxed{3}")]) == [False,
                                                                                                              True]
        assert pool.killed == 1
        assert time.monotonic() - t0 < 30
        assert pool.verify_many([("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}")]) == [True]  # the replacement works
    finally:
        pool.close()


def test_callable_from_threads(verifier):
    results = {}

    def work(k):
        results[k] = verifier.verify_batch([("0.5", "\\frac{1}{2}", "expression"), ("7", "8", "integer")])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[k] == [True, False] for k in range(3))


def test_unknown_answer_type_is_an_error(verifier):
    with pytest.raises(ValueError, match="answer_type"):
        verifier.is_equivalent("1", "1", "number")


def test_answer_keys_and_normalisation():
    assert normalise_string("  The  Eiffel-Tower! ") == "eiffel tower"
    assert answer_key("\\boxed{(C)}", "multiple_choice") == "C"
    assert answer_key("1,000", "integer") == "1000"
    assert answer_key(None, "string") is None


@pytest.mark.parametrize("pred,gold,same", [
    ("A", "(A)", True), ("(A)", "(A)", True), ("a", "A", True), ("(B)", "(A)", False),
    ("The A", "(A)", False),  # "the a" keeps both words: only all-article answers are kept whole
    ("a cat", "Cat", True), ("The Eiffel Tower", "eiffel tower", True), ("an", "An", True),
    ("", "A", False), ("the", "a", False), ("Paris, France", "paris france", True),
])
def test_string_normaliser_keeps_answers_made_of_articles(pred, gold, same):
    assert (normalise_string(pred) == normalise_string(gold) != "") is same


def test_bbeh_letter_targets_match(verifier):
    assert verifier.verify_batch([("(A)", "(A)", "string"), ("A", "(A)", "string"), ("B", "(A)", "string")]) == [
        True, True, False]


HUNG_POOL = """
import sys
from spice_megatron.selfplay.verify import MathVerifyPool

if __name__ == "__main__":
    pool = MathVerifyPool(processes=1, soft_timeout=600, hard_timeout=600.0)
    pool._ensure_workers()
    print(pool._workers[0].proc.pid, flush=True)
    pool.verify_many([("\\\\boxed{9^{9^{9^{9}}}}", "\\\\boxed{1}")])  # C-level work that reads no pipe
"""


def _gone(pid: int, timeout: float) -> bool:
    from leftovers import alive

    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.multiprocess
def test_a_busy_worker_dies_with_a_killed_run(tmp_path):
    """kill -9 of the process that holds the pool: its worker, deep in a huge power that never reads
    its pipe, is killed too (it outlived its test by 40 minutes before the parent-death signal)."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(HUNG_POOL)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    try:
        time.sleep(2.0)  # the worker is computing
        assert not _gone(worker, 0.0)
        proc.kill()
        proc.wait(30)
        assert _gone(worker, 15.0), f"math-verify worker {worker} outlived its killed parent"
    finally:
        if not _gone(worker, 0.0):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.multiprocess
def test_workers_started_from_a_thread_that_ends_keep_working():
    """The parent-death signal follows the thread that started a worker: the pool starts them from a
    thread of its own, so a caller's short-lived thread takes no worker with it."""
    pool = MathVerifyPool(processes=1, soft_timeout=2, hard_timeout=6.0)
    try:
        caller = threading.Thread(target=lambda: pool.verify_many([("\\boxed{2}", "\\boxed{2}")]))
        caller.start()
        caller.join(60)
        pid = pool._workers[0].proc.pid
        time.sleep(1.0)
        assert pool._workers[0].proc.is_alive()
        assert pool.verify_many([("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}")]) == [True]
        assert pool._workers[0].proc.pid == pid and pool.killed == 0
    finally:
        pool.close()
