"""When a SPICE iteration's generation requests go out: phased or streamed (run.streamed).

Phased: every document's challenger round r before round r+1 of the documents still without a
valid task, every challenger round before any reasoner request; each barrier waits for the slowest
sequence of the whole batch. Streamed: each document on its own; its next challenger round as soon
as its last one parsed without a valid task, its reasoner request as soon as its challenger group is
formed, its answers verified as soon as they are in, so the engines are fed from one queue of
every document's requests. Both make the same requests with the same seeds (doc_rollout.py): only
the order in time differs, and so the outcome is the same.
"""
from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

from spice_megatron.config import SelfPlayConfig
from spice_megatron.selfplay.doc_rollout import (
    Attempt,
    DocumentRollout,
    GenerateFn,
    challenger_round,
    reasoner_prompts,
    reasoner_spec,
)
from spice_megatron.selfplay.protocol import ChallengerPrompts
from spice_megatron.selfplay.verify import AnswerVerifier
from spice_megatron.tasks import extract_boxed


@dataclass
class RolloutSteps:
    """What a schedule calls, and the times and token counts it measures on the way."""

    challenger_generate: GenerateFn  # the policy's, or a fixed challenger model's
    reasoner_generate: GenerateFn
    prompts: ChallengerPrompts
    cfg: SelfPlayConfig
    verifier: AnswerVerifier
    tokenizer: object
    seed: int | None
    check: Callable[[Attempt], None] | None  # a valid task whose reasoner request cannot fit: made invalid
    start: float = field(default_factory=time.perf_counter)
    counters: Counter = field(default_factory=Counter)
    challenger_done: float = 0.0  # seconds into the iteration when the last challenger round came back
    reasoner_span: list[float] = field(default_factory=list)  # first reasoner submit, last answer back
    verify_seconds: float = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start

    def challenger(self, docs: list[DocumentRollout], n: int) -> tuple[list[list[Attempt]], Counter, tuple]:
        """n more attempts of each document, with its (submit, finish) seconds; safe off the main thread."""
        counters: Counter = Counter()
        submitted = self.now()
        rounds = challenger_round([d.doc for d in docs], n, self.challenger_generate, self.prompts, self.cfg,
                                  self.seed, counters, [(d.index, len(d.attempts)) for d in docs])
        return rounds, counters, (submitted, self.now())

    def add_round(self, docs: list[DocumentRollout], result: tuple) -> None:
        rounds, counters, span = result
        self.counters.update(counters)
        self.challenger_done = max(self.challenger_done, span[1])
        for d, attempts in zip(docs, rounds):
            d.add_attempts(attempts, span, self.check)

    def answer(self, docs: list[DocumentRollout]) -> tuple[list[list], tuple]:
        """G answers to every task of the documents' groups; safe off the main thread."""
        tasks = [a.parsed.task for d in docs for a in d.tasks]
        seeds = None if self.seed is None else [s for d in docs for s in d.answer_seeds(self.seed, self.cfg.group_size)]
        submitted = self.now()
        answers = self.reasoner_generate(reasoner_prompts(tasks, self.cfg, self.tokenizer),
                                         reasoner_spec(self.cfg, seeds)) if tasks else []
        return answers, (submitted, self.now())

    def add_answers(self, docs: list[DocumentRollout], result: tuple) -> None:
        """Verified: each document's tasks get their answers, extracted and checked."""
        answers, span = result
        first, last = self.reasoner_span or span
        self.reasoner_span = [min(first, span[0]), max(last, span[1])]
        t0 = time.perf_counter()
        tasks = [(d, a.parsed.task) for d in docs for a in d.tasks]
        extracted = [[extract_boxed(c.text) for c in comps] for comps in answers]
        correct = self.verifier.verify_batch([(pred, task.answer, task.answer_type)
                                              for (_, task), preds in zip(tasks, extracted) for pred in preds])
        self.verify_seconds += time.perf_counter() - t0
        self.counters["tokens/reasoner"] += sum(len(c.token_ids) for comps in answers for c in comps)
        k = 0
        for (d, _), comps, preds in zip(tasks, answers, extracted):
            d.answers.append(comps)
            d.extracted.append(preds)
            d.correct.append(correct[k:k + len(comps)])
            d.answer_s = span
            k += len(comps)
        for d in docs:
            d.choose_reasoner_task(self.cfg)

    def stats(self) -> dict[str, float]:
        reasoner = self.reasoner_span[1] - self.reasoner_span[0] if self.reasoner_span else 0.0
        return {"time/challenger_rollout": self.challenger_done, "time/reasoner_rollout": reasoner,
                "time/verify": self.verify_seconds, "tokens/reasoner": float(self.counters["tokens/reasoner"])}


def run_phased(docs: list[DocumentRollout], steps: RolloutSteps) -> None:
    """Round by round over the documents still without a valid task, then every reasoner request at once."""
    cfg = steps.cfg
    pending = [d for d in docs if d.next_round(cfg)]
    while pending:
        by_n: dict[int, list[DocumentRollout]] = {}  # documents near their N budget ask for fewer
        for d in pending:
            by_n.setdefault(d.next_round(cfg), []).append(d)
        for n, group in by_n.items():
            steps.add_round(group, steps.challenger(group, n))
        pending = [d for d in pending if d.next_round(cfg)]
    for d in docs:
        d.form_group(cfg)
    with_tasks = [d for d in docs if d.tasks]
    if with_tasks:
        steps.add_answers(with_tasks, steps.answer(with_tasks))


def run_streamed(docs: list[DocumentRollout], steps: RolloutSteps,
                 on_complete: Callable[[DocumentRollout], None] | None = None) -> None:
    """Each document's requests as soon as the last one it depends on is back; `on_complete(d)` once
    a document has all it trains. A request that fails (no engine left, a STOP) stops new
    submissions; those in flight are waited for (no request may outlive the iteration: a weight sync
    or a sleep follows) and the first error is raised."""
    cfg = steps.cfg
    running: dict[Future, tuple[str, DocumentRollout]] = {}
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=max(1, len(docs)), thread_name_prefix="spice-doc") as pool:
        def next_request(d: DocumentRollout) -> None:
            n = d.next_round(cfg)
            if n:
                running[pool.submit(steps.challenger, [d], n)] = ("challenger", d)
                return
            d.form_group(cfg)
            if d.tasks:
                running[pool.submit(steps.answer, [d])] = ("reasoner", d)
            elif on_complete is not None:
                on_complete(d)

        for d in docs:
            next_request(d)
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                kind, d = running.pop(future)
                try:
                    result = future.result()
                except BaseException as e:  # noqa: BLE001 - raised once nothing is in flight
                    error = error or e
                    continue
                if error is not None:
                    continue
                if kind == "challenger":
                    steps.add_round([d], result)
                    next_request(d)
                else:
                    steps.add_answers([d], result)
                    if on_complete is not None:
                        on_complete(d)
    if error is not None:
        raise error
