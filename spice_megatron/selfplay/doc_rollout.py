"""One document's way through a SPICE iteration's rollouts, whichever schedule runs it.

A `DocumentRollout` holds what the engines gave for one document: its challenger attempts (in
attempt order), its challenger group, the group's valid tasks and their G answers each. The steps
that change it are the same for the phased schedule (every document's round r before round r+1,
every challenger before any reasoner) and the streamed one (each document on its own,
rollout_schedule.py), and so are their inputs: sampling seeds per document and attempt
(`sampling_seed`) and a random generator per document drawn from the iteration's. So both schedules
give the same completions, groups and rewards from the same weights.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

from spice_megatron.config import SelfPlayConfig
from spice_megatron.data.corpus import Document
from spice_megatron.selfplay.loss import CHALLENGER
from spice_megatron.selfplay.protocol import ChallengerPrompts, parse_generation, parse_selection
from spice_megatron.selfplay.templates import reasoner_prompt
from spice_megatron.tasks import ParseResult, parse_challenger_output
from spice_megatron.wire.types import Completion, SamplingSpec

# prompts, sampling -> for each prompt, sampling.n completions
GenerateFn = Callable[[list[str], SamplingSpec], list[list[Completion]]]

# what a seed is for: sample k of a request seeded s samples with s + k (vLLM's rule for n > 1)
SELECTION, GENERATION, ANSWER = 0, 1, 2
_ATTEMPT_SLOTS = 4096  # seeds per document and kind: attempts (challenger) or attempts x G (reasoner)


def sampling_seed(seed: int | None, kind: int, doc: int, attempt: int, stride: int = 1) -> int | None:
    """The sampling seed of a document's attempt: of its challenger output (SELECTION: the compact
    protocol's task or the paper protocol's selection; GENERATION: the paper's generation that
    follows a selection), or of the first of the G answers to the task it wrote (ANSWER, stride G).
    Distinct per (iteration seed, kind, document, attempt) and independent of how requests are
    batched, so a streamed and a phased iteration, and a resumed one, sample the same."""
    if seed is None:
        return None
    return ((seed % 2**31) << 32) + (kind << 30) + ((doc * _ATTEMPT_SLOTS + attempt) * stride) % 2**30


@dataclass
class Attempt:
    """One challenger attempt: the trajectory that would be trained and what it produced."""

    prompt: str
    completion: Completion
    parsed: ParseResult
    record: int  # index of its audit record (set when the iteration's records are assembled)
    selection: Completion | None = None  # the paper protocol's selection output, when a generation followed
    number: int = 0  # the document's attempt number, from 1
    request_s: tuple[float, float] = (0.0, 0.0)  # its request's submit and finish, seconds into the iteration


@dataclass
class DocumentRollout:
    index: int  # the document's place in the iteration's batch
    doc: Document
    rng: random.Random  # this document's draws (its groups), from the iteration's generator
    attempts: list[Attempt] = field(default_factory=list)
    group: list[Attempt] = field(default_factory=list)  # the challenger group (trained when self-play)
    answers: list[list[Completion]] = field(default_factory=list)  # per valid task of the group, G answers
    extracted: list[list[str | None]] = field(default_factory=list)  # their \boxed{} contents
    correct: list[list[bool]] = field(default_factory=list)
    answer_s: tuple[float, float] = (0.0, 0.0)  # the reasoner request's submit and finish
    reasoner_task: int | None = None  # which of `tasks` is the reasoner group (its answers trained)

    @property
    def tasks(self) -> list[Attempt]:
        """The group's valid attempts: the tasks the reasoner answers, in group order."""
        return [a for a in self.group if a.parsed.valid]

    def next_round(self, cfg: SelfPlayConfig) -> int:
        """How many attempts the document's next challenger round asks for: 0 once it has a valid
        task or has spent its N."""
        if any(a.parsed.valid for a in self.attempts) or len(self.attempts) >= cfg.max_attempts:
            return 0
        return min(cfg.attempts_per_round, cfg.max_attempts - len(self.attempts))

    def add_attempts(self, attempts: list[Attempt], request_s: tuple[float, float],
                     check: Callable[[Attempt], None] | None) -> None:
        for a in attempts:
            a.number, a.request_s = len(self.attempts) + 1, request_s
            if check is not None and a.parsed.valid:
                check(a)
            self.attempts.append(a)

    def form_group(self, cfg: SelfPlayConfig) -> None:
        """The challenger group: G of the attempts, keeping the valid:invalid ratio (selfplay
        .challenger_group=document); or one attempt, a valid task if the document gave one (single)."""
        valid = [a for a in self.attempts if a.parsed.valid]
        invalid = [a for a in self.attempts if not a.parsed.valid]
        if cfg.challenger_group == "document":
            n_valid, n_invalid = group_counts(len(valid), len(invalid), cfg.group_size)
            self.group = self.rng.sample(valid, n_valid) + self.rng.sample(invalid, n_invalid)
        else:
            self.group = [self.rng.choice(valid or invalid)] if self.attempts else []

    def choose_reasoner_task(self, cfg: SelfPlayConfig) -> None:
        """The reasoner group: one of the valid tasks, drawn at random (among those at the reasoner's
        frontier first, under selfplay.reasoner_task=frontier). Once its answers are verified, the
        document is complete: every sequence it trains is known."""
        from spice_megatron.selfplay.rewards import at_frontier

        ks = list(range(len(self.correct)))
        frontier = [k for k in ks if at_frontier(self.correct[k])]
        self.reasoner_task = self.rng.choice(frontier if cfg.reasoner_task == "frontier" and frontier else ks)

    def answer_seeds(self, seed: int | None, g: int) -> list[int] | None:
        """The seed of each task's first answer (its k-th: that + k)."""
        if seed is None:
            return None
        return [sampling_seed(seed, ANSWER, self.index, a.number, g) for a in self.tasks]


def group_counts(valid: int, invalid: int, g: int) -> tuple[int, int]:
    """How many valid and invalid attempts form a document's challenger group of size g.

    All attempts when there are at most g. Otherwise the valid share is round(g * valid / total),
    halves rounded up, at least 1 when any attempt is valid (the reasoner needs a task), and never
    more than exist of either kind."""
    total = valid + invalid
    if total <= g:
        return valid, invalid
    n_valid = int(g * valid / total + 0.5)
    if valid:
        n_valid = max(n_valid, 1)
    n_valid = min(n_valid, valid)
    n_invalid = min(g - n_valid, invalid)
    return g - n_invalid, n_invalid


def reasoner_spec(cfg: SelfPlayConfig, seeds: list[int] | None, seed: int | None = None) -> SamplingSpec:
    """The reasoner's sampling: G answers per task, seeded per task (or, without `seeds`, from one seed)."""
    from spice_megatron.selfplay.loss import REASONER

    return SamplingSpec(n=cfg.group_size, temperature=cfg.reasoner_temperature, top_p=cfg.top_p,
                        max_tokens=cfg.reasoner_max_tokens, stop=tuple(cfg.reasoner_stop), seed=seed,
                        seeds=tuple(seeds or ()), role=REASONER)


def reasoner_prompts(tasks: list, cfg: SelfPlayConfig, tokenizer) -> list[str]:
    return [reasoner_prompt(t, cfg.template, tokenizer, cfg.prompt_dir) for t in tasks]


def challenger_round(docs: list[Document], n: int, generate: GenerateFn, prompts: ChallengerPrompts,
                     cfg: SelfPlayConfig, seed: int | None, counters: Counter,
                     doc_seeds: list[tuple[int, int]] | None = None) -> list[list[Attempt]]:
    """n attempts for each document (one generation call per protocol step). `doc_seeds`: per
    document, its (batch index, attempts so far), so that attempt a of document d samples with
    `sampling_seed(seed, ..., d, a)` however the round is batched; without them the round's prompts
    sample with `seed` + their index (the challenger evaluation's fixed stories)."""
    def spec_for(kind: int, slots: list[tuple[int, int]], **changes) -> SamplingSpec:
        base = SamplingSpec(n=n, temperature=cfg.challenger_temperature, top_p=cfg.top_p,
                            max_tokens=cfg.challenger_max_tokens, role=CHALLENGER)
        if doc_seeds is None or seed is None:
            plain = seed if kind == SELECTION or seed is None else (seed + 7919) % 2**31
            return replace(base, seed=plain, **changes)
        return replace(base, seeds=tuple(sampling_seed(seed, kind, d, a) for d, a in slots), **changes)

    if cfg.protocol == "compact":
        texts = [prompts.compact_prompt(d.text) for d in docs]
        # stop at the task's last tag: a model that goes on (a few-shot prompt's next example) would
        # otherwise have its last tags read instead of the first
        outs = generate(texts, spec_for(SELECTION, doc_seeds or [], stop=(prompts.compact_stop,)))
        counters["tokens/challenger"] += sum(len(c.token_ids) for comps in outs for c in comps)
        return [[Attempt(p, c, parse_challenger_output(c.text, cfg.leak_check), -1) for c in comps]
                for p, comps in zip(texts, outs)]

    # paper: selection (n per document), then one generation per valid selection
    sel_prompts = [prompts.selection_prompt(d.text) for d in docs]
    selections = generate(sel_prompts, spec_for(SELECTION, doc_seeds or [], max_tokens=cfg.selection_max_tokens))
    counters["tokens/challenger_selection"] += sum(len(c.token_ids) for comps in selections for c in comps)
    result: list[list[Attempt | None]] = [[None] * n for _ in docs]
    gen_prompts, slots, gen_seeds = [], [], []
    for d, (doc_, comps) in enumerate(zip(docs, selections)):
        for j, c in enumerate(comps):
            sel = parse_selection(c.text)
            counters["selections"] += 1
            if sel.selection is None:  # the selection output itself is the trajectory, penalised
                result[d][j] = Attempt(sel_prompts[d], c, ParseResult(None, sel.reason), -1)
            else:
                counters["selections_valid"] += 1
                gen_prompts.append(prompts.generation_prompt(doc_.text, sel.selection))
                slots.append((d, j, c, sel.selection))
                if doc_seeds is not None:
                    gen_seeds.append((doc_seeds[d][0], doc_seeds[d][1] + j))
    if gen_prompts:
        outs = generate(gen_prompts, spec_for(GENERATION, gen_seeds, n=1))
        for p, (d, j, sel_completion, selection), (c,) in zip(gen_prompts, slots, outs):
            counters["tokens/challenger"] += len(c.token_ids)
            result[d][j] = Attempt(p, c, parse_generation(c.text, selection, cfg.leak_check), -1, sel_completion)
    return result  # type: ignore[return-value]
