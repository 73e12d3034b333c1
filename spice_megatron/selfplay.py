"""One SPICE iteration's data (Algorithm 1): documents -> challenger groups -> G answers per valid
task -> rewards -> role-specific advantages -> training samples.

Per document, with selfplay.challenger_group = "document" (the paper's):
  - challenger attempts in rounds until one is a valid task, at most N (max_attempts);
  - the challenger group: G of the attempts, keeping the valid:invalid ratio (`group_counts`);
  - every valid task in the group gets G reasoner answers and the variance reward, every invalid
    attempt the penalty rho; challenger advantages are centred within the document's group;
  - one valid task of the group, drawn at random, is the reasoner group: its G answers (the same
    ones that gave the variance) are trained, centred per question.
  So a document yields up to G challenger and G reasoner trajectories.
With "single" (compact): one attempt per document (a valid one if any), one task answered, the
challenger advantages centred over the batch.

The generate function is the only link to a model: the trainer passes the rollout fleet's, tests
pass a scripted one. Everything here is deterministic given the generator's outputs and `rng`.
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import torch

from spice_megatron.config import SelfPlayConfig
from spice_megatron.corpus import Document
from spice_megatron.loss import CHALLENGER, REASONER, role_advantages
from spice_megatron.protocol import ChallengerPrompts, parse_generation, parse_selection
from spice_megatron.rewards import at_frontier, challenger_reward, reasoner_reward
from spice_megatron.rollout.types import Completion, SamplingSpec
from spice_megatron.tasks import ParseResult, Task, answer_in_question, extract_boxed, parse_challenger_output
from spice_megatron.templates import reasoner_prompt
from spice_megatron.verify import AnswerVerifier, answer_key

log = logging.getLogger(__name__)

# prompts, sampling -> for each prompt, sampling.n completions
GenerateFn = Callable[[list[str], SamplingSpec], list[list[Completion]]]


@dataclass
class Sample:
    """One training sequence with its role-specific advantage."""

    role: str
    prompt: str
    completion: Completion
    reward: float
    advantage: float
    group: int  # the group its advantage is centred in: challenger: document (-1: batch); reasoner: task
    doc_id: str


@dataclass
class IterationResult:
    samples: list[Sample]
    stats: dict[str, float]
    records: list[dict]  # the audit trail: every challenger attempt and reasoner answer


@dataclass
class Attempt:
    """One challenger attempt: the trajectory that would be trained and what it produced."""

    prompt: str
    completion: Completion
    parsed: ParseResult
    record: int  # index of its audit record
    selection: Completion | None = None  # the paper protocol's selection output, when a generation followed


@dataclass
class Reservoir:
    """A uniform random sample of up to k items of a stream, without storing the stream."""

    k: int
    items: list = field(default_factory=list)
    seen: int = 0

    def offer(self, item, rng: random.Random) -> None:
        self.seen += 1
        if len(self.items) < self.k:
            self.items.append(item)
        else:
            j = rng.randrange(self.seen)
            if j < self.k:
                self.items[j] = item


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


def _round_seed(seed: int | None, attempt: int) -> int | None:
    """A distinct sampling seed per generation call, so that a resumed run samples the same."""
    return None if seed is None else (seed * 1_000_003 + (attempt + 2) * 65_536) % 2**31  # prompt i adds i


def run_iteration(documents: Sequence[Document], generate: GenerateFn, verifier: AnswerVerifier,
                  cfg: SelfPlayConfig, rng: random.Random, tokenizer=None, weights_version: int = 0,
                  iteration: int = 0, seed: int | None = None,
                  challenger_generate: GenerateFn | None = None, max_model_len: int | None = None,
                  token_ids: Callable[[str], list[int]] | None = None) -> IterationResult:
    """One iteration's data. `seed` (None: unseeded sampling) makes the engine's sampling
    reproducible for exact resume. `challenger_generate`: a fixed challenger model's generate
    function (selfplay.challenger=model); its attempts are recorded, never trained.
    `max_model_len` (with a tokenizer): a document whose challenger request would not fit the
    engines' context is skipped (counted, logged, recorded), and a task whose reasoner request would
    not fit is an invalid attempt, rather than a request vLLM truncates or rejects. `token_ids`: the
    caller's (cached) prompt tokenisation, so that a reasoner prompt measured here is not tokenised
    again when it is sent."""
    stats: dict[str, float] = {}
    # a fixed challenger may have a format of its own (selfplay.challenger_template)
    challenger_template = (cfg.challenger_template if challenger_generate else "") or cfg.template
    grounded = cfg.grounding == "document"
    prompts = ChallengerPrompts(challenger_template, tokenizer, cfg.prompt_dir, grounded)
    context = max_model_len if tokenizer is not None else None
    records: list[dict] = []
    if context:
        documents, too_long = _documents_that_fit(documents, prompts, cfg, tokenizer, context)
        stats["skipped/prompt_too_long"] = float(len(too_long))
        records += [{"kind": "document", "iteration": iteration, "doc_id": d.doc_id, "doc_sha256": d.sha256,
                     "weights_version": weights_version, "text": d.text, "skipped": why} for d, why in too_long]
    # the documents the challenger read, first: `spice audit` shows each task beside its document
    # (selfplay.grounding=none: drawn for the schedule, never shown; "shown" says so)
    records += [{"kind": "document", "iteration": iteration, "doc_id": d.doc_id, "doc_sha256": d.sha256,
                 "weights_version": weights_version, "text": d.text, "shown": grounded} for d in documents]
    n_docs = len(documents)
    per_doc = cfg.group_size if cfg.challenger_group == "document" else 1

    # --- Challenger: attempts in rounds until each document has a valid task or N are spent.
    t0 = time.perf_counter()
    attempts = [0] * n_docs
    valid = [Reservoir(per_doc) for _ in range(n_docs)]
    invalid = [Reservoir(per_doc) for _ in range(n_docs)]
    reasons: Counter = Counter()
    counters = Counter()
    pending = list(range(n_docs))
    while pending:
        # Documents in the same round get the same n, except those near their N budget.
        by_n: dict[int, list[int]] = {}
        for i in pending:
            by_n.setdefault(min(cfg.attempts_per_round, cfg.max_attempts - attempts[i]), []).append(i)
        for n, idx in by_n.items():
            round_seed = _round_seed(seed, attempts[idx[0]])
            for i, att in zip(idx, challenger_round([documents[i] for i in idx], n, challenger_generate or generate,
                                                    prompts, cfg, round_seed, counters)):
                for a in att:
                    attempts[i] += 1
                    if context and a.parsed.valid:
                        _check_reasoner_request(a, cfg, tokenizer, context, token_ids)
                    records.append(_challenger_record(documents[i], attempts[i], a, weights_version, iteration,
                                                      grounded))
                    a.record = len(records) - 1
                    if a.parsed.valid:
                        valid[i].offer(a, rng)
                    else:
                        reasons[a.parsed.reason] += 1
                        invalid[i].offer(a, rng)
        pending = [i for i in pending if not valid[i].seen and attempts[i] < cfg.max_attempts]
    stats["time/challenger_rollout"] = time.perf_counter() - t0

    # --- The challenger groups.
    groups: list[list[Attempt]] = []
    for i in range(n_docs):
        if cfg.challenger_group == "document":
            n_valid, n_invalid = group_counts(valid[i].seen, invalid[i].seen, cfg.group_size)
            groups.append(rng.sample(valid[i].items, n_valid) + rng.sample(invalid[i].items, n_invalid))
        else:  # one attempt: a valid task if the document gave one
            groups.append(valid[i].items[:1] or invalid[i].items[:1])

    # --- Reasoner: G answers for every valid task in a group, without the document.
    task_of: list[tuple[int, Attempt]] = [(i, a) for i, group in enumerate(groups) for a in group if a.parsed.valid]
    tasks: list[Task] = [a.parsed.task for _, a in task_of]
    answered = answer_tasks(tasks, generate, verifier, cfg, tokenizer, seed, stats)
    r_prompts, flat, correct, outcomes = answered.prompts, answered.flat, answered.correct, answered.outcomes

    # --- Rewards: the variance of each task's G outcomes (its challenger reward).
    task_reward = [challenger_reward(o, True, cfg.challenger_reward, answers=a, invalid_penalty=cfg.invalid_penalty)
                   for o, a in zip(outcomes, answered.keys)]
    reward_of = {id(a): r for (_, a), r in zip(task_of, task_reward)}

    # --- The reasoner group of each document: one of its valid tasks, drawn at random (among those
    # at the reasoner's frontier first, under reasoner_task=frontier).
    tasks_by_doc: dict[int, list[int]] = {}
    for k, (i, _) in enumerate(task_of):
        tasks_by_doc.setdefault(i, []).append(k)
    trained_task: dict[int, int] = {}
    for i, ks in sorted(tasks_by_doc.items()):
        frontier = [k for k in ks if at_frontier(outcomes[k])]
        trained_task[i] = rng.choice(frontier if cfg.reasoner_task == "frontier" and frontier else ks)

    samples: list[Sample] = []
    sample_record: list[int] = []  # audit record index of each sample, to write its advantage back
    # A fixed challenger (selfplay.challenger=model) writes the tasks but is not trained.
    train_challenger = challenger_generate is None
    for i, group in enumerate(groups):
        centre = i if cfg.challenger_group == "document" else -1
        for a in group if train_challenger else ():
            reward = reward_of[id(a)] if a.parsed.valid else cfg.invalid_penalty
            samples.append(Sample(CHALLENGER, a.prompt, a.completion, reward, 0.0, centre, documents[i].doc_id))
            sample_record.append(a.record)
    trained_keys = set(trained_task.values())
    for (k, c, pred), ok in zip(flat, correct):
        i = task_of[k][0]
        records.append({"kind": "reasoner", "iteration": iteration, "doc_id": documents[i].doc_id,
                        "task_index": k, "challenger_record": task_of[k][1].record,
                        "weights_version": weights_version, "versions": c.versions, "text": c.text,
                        "extracted": pred, "correct": ok, "reward": reasoner_reward(ok), "trained": False})
        if k in trained_keys:
            samples.append(Sample(REASONER, r_prompts[k], c, reasoner_reward(ok), 0.0, k, documents[i].doc_id))
            sample_record.append(len(records) - 1)

    # --- Role-specific advantages (centred per group, no std normalisation).
    if samples:
        adv = role_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                              [s.role for s in samples], [s.group for s in samples])
        for s, a, rec in zip(samples, adv.tolist(), sample_record):
            s.advantage = a
            records[rec].update(advantage=a, trained=True, reward=s.reward)
    answer_versions: dict[int, set] = {}  # the weights that sampled the answers a task's reward came from
    for k, c, _ in flat:
        answer_versions.setdefault(k, set()).update(v for v, _, _ in c.versions)
    for k, (i, a) in enumerate(task_of):
        records[a.record].update(outcomes=outcomes[k], pass_rate=sum(outcomes[k]) / len(outcomes[k]),
                                 reasoner_group=k in trained_keys,
                                 answer_versions=sorted(answer_versions.get(k, ()),
                                                        key=lambda v: (isinstance(v, str), v)))

    stats.update(_statistics(n_docs, attempts, groups, tasks, outcomes, task_reward, samples, reasons, counters, cfg))
    stats["challenger_mode"] = "self" if train_challenger else "model"
    for r in records:
        r["challenger_mode"] = stats["challenger_mode"]
    return IterationResult(samples, stats, records)


@dataclass
class Answered:
    prompts: list[str]
    flat: list[tuple[int, Completion, str | None]]  # (task index, answer, extracted \boxed{} content)
    correct: list[bool]
    outcomes: list[list[bool]]  # per task, its G outcomes
    keys: list[list[str | None]]  # per task, its G normalised answers (R-Zero's reward)


def answer_tasks(tasks: list[Task], generate: GenerateFn, verifier: AnswerVerifier, cfg: SelfPlayConfig,
                 tokenizer, seed: int | None, stats: dict[str, float]) -> Answered:
    """G reasoner answers per task (the question only, never the document), verified."""
    t0 = time.perf_counter()
    prompts = [reasoner_prompt(t, cfg.template, tokenizer, cfg.prompt_dir) for t in tasks]
    answers = generate(prompts, SamplingSpec(
        n=cfg.group_size, temperature=cfg.reasoner_temperature, top_p=cfg.top_p, max_tokens=cfg.reasoner_max_tokens,
        stop=tuple(cfg.reasoner_stop), seed=_round_seed(seed, -1), role=REASONER)) if tasks else []
    stats["time/reasoner_rollout"] = time.perf_counter() - t0
    stats["tokens/reasoner"] = sum(len(c.token_ids) for comps in answers for c in comps)
    t0 = time.perf_counter()
    flat = [(k, c, extract_boxed(c.text)) for k, comps in enumerate(answers) for c in comps]
    correct = verifier.verify_batch([(pred, tasks[k].answer, tasks[k].answer_type) for k, _, pred in flat])
    stats["time/verify"] = time.perf_counter() - t0
    outcomes: list[list[bool]] = [[] for _ in tasks]
    keys: list[list[str | None]] = [[] for _ in tasks]
    for (k, _, pred), ok in zip(flat, correct):
        outcomes[k].append(ok)
        keys[k].append(answer_key(pred, tasks[k].answer_type))
    return Answered(prompts, flat, correct, outcomes, keys)


def run_fixed_tasks(pool_tasks: Sequence, generate: GenerateFn, verifier: AnswerVerifier, cfg: SelfPlayConfig,
                    tokenizer=None, weights_version: int = 0, iteration: int = 0,
                    seed: int | None = None) -> IterationResult:
    """selfplay.challenger=tasks: tasks from a file (task_pool.PoolTask) stand in for the challenger;
    each gets G answers and only the reasoner is trained, centred per question."""
    stats: dict[str, float] = {}
    tasks = [pt.task for pt in pool_tasks]
    answered = answer_tasks(tasks, generate, verifier, cfg, tokenizer, seed, stats)
    samples, records = [], []
    for k, pt in enumerate(pool_tasks):
        records.append({"kind": "task", "iteration": iteration, "doc_id": pt.doc_id, "task": asdict(pt.task),
                        "weights_version": weights_version, "outcomes": answered.outcomes[k],
                        "pass_rate": sum(answered.outcomes[k]) / max(1, len(answered.outcomes[k])), "trained": False})
    for (k, c, pred), ok in zip(answered.flat, answered.correct):  # record k is task k's
        records.append({"kind": "reasoner", "iteration": iteration, "doc_id": pool_tasks[k].doc_id, "task_index": k,
                        "challenger_record": k, "weights_version": weights_version, "versions": c.versions,
                        "text": c.text,
                        "extracted": pred, "correct": ok, "reward": reasoner_reward(ok), "trained": True})
        samples.append(Sample(REASONER, answered.prompts[k], c, reasoner_reward(ok), 0.0, k, pool_tasks[k].doc_id))
    if samples:
        adv = role_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                              [s.role for s in samples], [s.group for s in samples])
        for s, a, rec in zip(samples, adv.tolist(), records[len(pool_tasks):]):
            s.advantage = a
            rec["advantage"] = a
    for r in records:
        r["challenger_mode"] = "tasks"
    stats.update(_statistics(len(tasks), [0] * len(tasks), [], tasks, answered.outcomes, [], samples, Counter(),
                             Counter(), cfg))
    stats["valid_task_rate"] = 1.0  # every file task is a task: the kill switch's valid-task rule does not apply
    stats["challenger_mode"] = "tasks"
    return IterationResult(samples, stats, records)


def _documents_that_fit(documents: Sequence[Document], prompts: ChallengerPrompts, cfg: SelfPlayConfig, tokenizer,
                        context: int) -> tuple[list[Document], list[tuple[Document, str]]]:
    """The documents whose every challenger request fits `context`, and the others with why."""
    from spice_megatron.context_budget import EDGE_TOKENS, challenger_overheads

    overheads = challenger_overheads(prompts, cfg, tokenizer)
    fit, too_long = [], []
    for d in documents:
        need, what = max((prompt_len + d.num_tokens + EDGE_TOKENS + max_tokens, what)
                         for what, prompt_len, max_tokens in overheads)
        if need <= context:
            fit.append(d)
        else:
            why = f"prompt_too_long: the {what} and its output are {need} tokens, max_model_len {context}"
            log.warning("skipping document %s: %s", d.doc_id, why)
            too_long.append((d, why))
    return fit, too_long


def _check_reasoner_request(a: "Attempt", cfg: SelfPlayConfig, tokenizer, context: int,
                            token_ids: Callable[[str], list[int]] | None = None) -> None:
    """A valid task whose reasoner request cannot fit the context becomes an invalid attempt."""
    from spice_megatron.templates import prompt_token_ids

    prompt = reasoner_prompt(a.parsed.task, cfg.template, tokenizer, cfg.prompt_dir)
    need = len(token_ids(prompt) if token_ids else prompt_token_ids(prompt, tokenizer)) + cfg.reasoner_max_tokens
    if need > context:
        a.parsed = ParseResult(None, "question_over_context", {"tokens": need, "max_model_len": context})


def challenger_round(docs: list[Document], n: int, generate: GenerateFn, prompts: ChallengerPrompts,
                     cfg: SelfPlayConfig, seed: int | None, counters: Counter) -> list[list[Attempt]]:
    """n attempts for each document (one generation call per protocol step)."""
    spec = SamplingSpec(n=n, temperature=cfg.challenger_temperature, top_p=cfg.top_p,
                        max_tokens=cfg.challenger_max_tokens, seed=seed, role=CHALLENGER)
    if cfg.protocol == "compact":
        texts = [prompts.compact_prompt(d.text) for d in docs]
        # stop at the task's last tag: a model that goes on (a few-shot prompt's next example) would
        # otherwise have its last tags read instead of the first
        outs = generate(texts, replace(spec, stop=(prompts.compact_stop,)))
        counters["tokens/challenger"] += sum(len(c.token_ids) for comps in outs for c in comps)
        return [[Attempt(p, c, parse_challenger_output(c.text, cfg.leak_check), -1) for c in comps]
                for p, comps in zip(texts, outs)]

    # paper: selection (n per document), then one generation per valid selection
    sel_prompts = [prompts.selection_prompt(d.text) for d in docs]
    selections = generate(sel_prompts, replace(spec, max_tokens=cfg.selection_max_tokens))
    counters["tokens/challenger_selection"] += sum(len(c.token_ids) for comps in selections for c in comps)
    result: list[list[Attempt | None]] = [[None] * n for _ in docs]
    gen_prompts, slots = [], []
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
    if gen_prompts:
        gen_seed = None if seed is None else (seed + 7919) % 2**31
        outs = generate(gen_prompts, replace(spec, n=1, seed=gen_seed))
        for p, (d, j, sel_completion, selection), (c,) in zip(gen_prompts, slots, outs):
            counters["tokens/challenger"] += len(c.token_ids)
            result[d][j] = Attempt(p, c, parse_generation(c.text, selection, cfg.leak_check), -1, sel_completion)
    return result  # type: ignore[return-value]


def _challenger_record(doc: Document, attempt: int, a: Attempt, weights_version: int, iteration: int,
                       grounded: bool = True) -> dict:
    rec = {"kind": "challenger", "iteration": iteration, "doc_id": doc.doc_id, "doc_sha256": doc.sha256,
           "grounded": grounded,  # false: no document grounded the task (selfplay.grounding=none)
           "attempt": attempt, "weights_version": weights_version, "versions": a.completion.versions,
           "text": a.completion.text, "valid": a.parsed.valid,
           "reason": a.parsed.reason, "task": asdict(a.parsed.task) if a.parsed.task else None, "trained": False}
    if a.selection is not None:
        rec["selection"] = a.selection.text
    return rec


def _statistics(n_docs: int, attempts: list[int], groups: list[list[Attempt]], tasks: list[Task],
                outcomes: list[list[bool]], task_reward: list[float], samples: list[Sample],
                reasons: Counter, counters: Counter, cfg: SelfPlayConfig) -> dict[str, float]:
    s: dict[str, float] = {}
    total_attempts = sum(attempts)
    with_task = sum(any(a.parsed.valid for a in g) for g in groups)
    s["valid_task_rate"] = with_task / n_docs if n_docs else 0.0
    s["attempts_per_doc"] = total_attempts / n_docs if n_docs else 0.0
    s["attempts_per_doc_max"] = float(max(attempts, default=0))
    s["challenger_parse_rate"] = (total_attempts - sum(reasons.values())) / total_attempts if total_attempts else 0.0
    s["tokens/challenger"] = float(counters["tokens/challenger"] + counters["tokens/challenger_selection"])
    if counters["selections"]:
        s["selection_valid_rate"] = counters["selections_valid"] / counters["selections"]
    for reason, count in reasons.items():
        s[f"invalid/{reason}"] = count / total_attempts
    # challenger group composition (Algorithm 1: G per document, valid:invalid ratio kept)
    n_docs = n_docs or 1
    s["challenger/group_valid"] = sum(a.parsed.valid for g in groups for a in g) / n_docs
    s["challenger/group_invalid"] = sum(not a.parsed.valid for g in groups for a in g) / n_docs
    s["challenger/groups_without_task"] = float(len(groups) - with_task)
    types = Counter(t.answer_type for t in tasks)
    for answer_type in ("multiple_choice", "integer", "expression", "string"):
        s[f"mix/{answer_type}"] = types[answer_type] / len(tasks) if tasks else 0.0
    hist = Counter(sum(o) for o in outcomes)
    for k in range(cfg.group_size + 1):
        s[f"pass_hist/{k}"] = float(hist[k])
    answers = [ok for o in outcomes for ok in o]
    reasoner = [x for x in samples if x.role == REASONER]
    s["reasoner_no_boxed_rate"] = (sum(extract_boxed(x.completion.text) is None for x in reasoner) / len(reasoner)
                                   if reasoner else 0.0)
    s["reasoner_pass_rate"] = sum(answers) / len(answers) if answers else 0.0
    s["challenger_reward_mean"] = sum(task_reward) / len(task_reward) if task_reward else 0.0
    # tasks at the reasoner's frontier (0 < pass rate < 1: the variance reward's aim), and tasks whose
    # answer stands in their question (a reasoner copies it: pass rate near 1, little reward)
    s["challenger/frontier_share"] = sum(map(at_frontier, outcomes)) / len(outcomes) if outcomes else 0.0
    s["challenger/leak_rate"] = sum(answer_in_question(t) for t in tasks) / len(tasks) if tasks else 0.0
    for role in (CHALLENGER, REASONER):
        adv = torch.tensor([x.advantage for x in samples if x.role == role], dtype=torch.float64)
        rew = [x.reward for x in samples if x.role == role]
        s[f"{role}/samples"] = float(len(rew))
        s[f"{role}/reward_mean"] = sum(rew) / len(rew) if rew else 0.0
        s[f"{role}/advantage_mean"] = adv.mean().item() if adv.numel() else 0.0
        s[f"{role}/advantage_std"] = adv.std(unbiased=False).item() if adv.numel() else 0.0
        s[f"{role}/advantage_abs_max"] = adv.abs().max().item() if adv.numel() else 0.0
        s[f"{role}/nonzero_advantage_rate"] = (adv.abs() > 1e-12).double().mean().item() if adv.numel() else 0.0
    return s
