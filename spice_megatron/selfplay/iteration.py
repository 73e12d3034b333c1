"""One SPICE iteration's data (Algorithm 1): documents -> challenger groups -> G answers per valid
task -> rewards -> role-specific advantages -> training samples.

Per document, with selfplay.challenger_group = "document" (the paper's):
  - challenger attempts in rounds until one is a valid task, at most N (max_attempts);
  - the challenger group: G of the attempts, keeping the valid:invalid ratio (doc_rollout.group_counts);
  - every valid task in the group gets G reasoner answers and the variance reward, every invalid
    attempt the penalty rho; challenger advantages are centred within the document's group;
  - one valid task of the group, drawn at random, is the reasoner group: its G answers (the same
    ones that gave the variance) are trained, centred per question.
  So a document yields up to G challenger and G reasoner trajectories.
With "single" (compact): one attempt per document (a valid one if any), one task answered, the
challenger advantages centred over the batch.

The generate function is the only link to a model: the trainer passes the rollout fleet's, tests
pass a scripted one. Everything here is deterministic given the generator's outputs and `rng`, and
the same whichever schedule sent the requests (phased or streamed: selfplay/schedule.py).
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from spice_megatron.config import SelfPlayConfig
from spice_megatron.data.corpus import Document
from spice_megatron.selfplay.doc_rollout import Attempt, DocumentRollout, GenerateFn, reasoner_prompts
from spice_megatron.selfplay.loss import CHALLENGER, REASONER, role_advantages
from spice_megatron.selfplay.protocol import ChallengerPrompts
from spice_megatron.selfplay.rewards import at_frontier, challenger_reward, reasoner_reward
from spice_megatron.selfplay.schedule import RolloutSteps, run_phased, run_streamed
from spice_megatron.selfplay.templates import reasoner_prompt
from spice_megatron.selfplay.verify import AnswerVerifier, answer_key
from spice_megatron.tasks import ANSWER_TYPES, INVALID_REASONS, ParseResult, Task, answer_in_question, extract_boxed
from spice_megatron.wire.types import Completion, SamplingSpec

log = logging.getLogger(__name__)


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


def _round_seed(seed: int | None, attempt: int) -> int | None:
    """A distinct sampling seed per generation call, so that a resumed run samples the same."""
    return None if seed is None else (seed * 1_000_003 + (attempt + 2) * 65_536) % 2**31  # prompt i adds i


def run_iteration(documents: Sequence[Document], generate: GenerateFn, verifier: AnswerVerifier,
                  cfg: SelfPlayConfig, rng: random.Random, tokenizer=None, rollout_version: int = 0,
                  iteration: int = 0, seed: int | None = None,
                  challenger_generate: GenerateFn | None = None, max_model_len: int | None = None,
                  token_ids: Callable[[str], list[int]] | None = None, streamed: bool = False,
                  on_document: Callable[[list[tuple[str, str, Completion]]], None] | None = None) -> IterationResult:
    """One iteration's data. `seed` (None: unseeded sampling) makes the engine's sampling
    reproducible for exact resume. `challenger_generate`: a fixed challenger model's generate
    function (selfplay.challenger=model); its attempts are recorded, never trained.
    `max_model_len` (with a tokenizer): a document whose challenger request would not fit the
    engines' context is skipped (counted, logged, recorded), and a task whose reasoner request would
    not fit is an invalid attempt, rather than a request vLLM truncates or rejects. `token_ids`: the
    caller's (cached) prompt tokenisation, so that a reasoner prompt measured here is not tokenised
    again when it is sent. `streamed`: each document's requests as soon as it can make them
    (selfplay/schedule.py); the same outcome as the phased schedule. `on_document` (streamed): called
    with each document's trained (role, prompt, completion) as soon as it is complete, so that the
    learner can run their old log-probs while the other documents roll out."""
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
                     "rollout_version": rollout_version, "text": d.text, "skipped": why} for d, why in too_long]
    # the documents the challenger read, first: `spice audit` shows each task beside its document
    # (selfplay.grounding=none: drawn for the schedule, never shown; "shown" says so)
    records += [{"kind": "document", "iteration": iteration, "doc_id": d.doc_id, "doc_sha256": d.sha256,
                 "rollout_version": rollout_version, "text": d.text, "shown": grounded} for d in documents]
    # each document draws from a generator of its own, so that the order in which documents finish
    # (streamed) does not change what they draw
    docs = [DocumentRollout(i, d, random.Random(rng.getrandbits(64))) for i, d in enumerate(documents)]
    check = (lambda a: _check_reasoner_request(a, cfg, tokenizer, context, token_ids)) if context else None
    steps = RolloutSteps(challenger_generate or generate, generate, prompts, cfg, verifier, tokenizer, seed, check)
    train_challenger = challenger_generate is None
    if streamed:
        done = None if on_document is None else (
            lambda d: on_document(document_sequences(d, cfg, train_challenger, tokenizer)))
        run_streamed(docs, steps, done)
    else:
        run_phased(docs, steps)
    stats.update(steps.stats())
    return _assemble(docs, records, steps.counters, stats, cfg, tokenizer, rollout_version, iteration, grounded,
                     train_challenger)


def document_sequences(d: DocumentRollout, cfg: SelfPlayConfig, train_challenger: bool,
                       tokenizer) -> list[tuple[str, str, Completion]]:
    """The (role, prompt, completion) a complete document trains: its challenger group (unless a
    fixed challenger wrote it) and its reasoner group's G answers, as `_assemble` makes them samples."""
    out = [(CHALLENGER, a.prompt, a.completion) for a in (d.group if train_challenger else ())]
    if d.reasoner_task is not None:
        prompt = reasoner_prompts([d.tasks[d.reasoner_task].parsed.task], cfg, tokenizer)[0]
        out += [(REASONER, prompt, c) for c in d.answers[d.reasoner_task]]
    return out


def _assemble(docs: list[DocumentRollout], records: list[dict], counters: Counter, stats: dict[str, float],
              cfg: SelfPlayConfig, tokenizer, rollout_version: int, iteration: int, grounded: bool,
              train_challenger: bool) -> IterationResult:
    """Records, rewards, samples and advantages of the documents' rollouts, in document order."""
    for d in docs:  # every challenger attempt, in the document's attempt order
        for a in d.attempts:
            records.append(_challenger_record(d.doc, a, rollout_version, iteration, grounded))
            a.record = len(records) - 1
    reasons = Counter(a.parsed.reason for d in docs for a in d.attempts if not a.parsed.valid)
    # the iteration's tasks, document after document: task k is the reasoner group k's question
    task_of = [(d, a, j) for d in docs for j, a in enumerate(d.tasks)]
    outcomes = [d.correct[j] for d, _, j in task_of]
    keys = [[answer_key(p, a.parsed.task.answer_type) for p in d.extracted[j]] for d, a, j in task_of]

    # --- Rewards: the variance of each task's G outcomes (its challenger reward).
    task_reward = [challenger_reward(o, True, cfg.challenger_reward, answers=k, invalid_penalty=cfg.invalid_penalty)
                   for o, k in zip(outcomes, keys)]
    reward_of = {id(a): r for (_, a, _), r in zip(task_of, task_reward)}

    # --- The reasoner group of each document (DocumentRollout.choose_reasoner_task).
    trained_keys = {k for k, (d, _, j) in enumerate(task_of) if j == d.reasoner_task}

    samples: list[Sample] = []
    sample_record: list[int] = []  # audit record index of each sample, to write its advantage back
    # A fixed challenger (selfplay.challenger=model) writes the tasks but is not trained.
    for d in docs:
        centre = d.index if cfg.challenger_group == "document" else -1
        for a in d.group if train_challenger else ():
            reward = reward_of[id(a)] if a.parsed.valid else cfg.invalid_penalty
            samples.append(Sample(CHALLENGER, a.prompt, a.completion, reward, 0.0, centre, d.doc.doc_id))
            sample_record.append(a.record)
    r_prompts = reasoner_prompts([a.parsed.task for _, a, _ in task_of], cfg, tokenizer)
    for k, (d, a, j) in enumerate(task_of):
        for c, pred, ok in zip(d.answers[j], d.extracted[j], d.correct[j]):
            records.append({"kind": "reasoner", "iteration": iteration, "doc_id": d.doc.doc_id,
                            "task_index": k, "challenger_record": a.record,
                            "rollout_version": rollout_version, "versions": c.versions, "text": c.text,
                            "extracted": pred, "correct": ok, "reward": reasoner_reward(ok), "trained": False,
                            "request_s": [round(t, 3) for t in d.answer_s]})
            if k in trained_keys:
                samples.append(Sample(REASONER, r_prompts[k], c, reasoner_reward(ok), 0.0, k, d.doc.doc_id))
                sample_record.append(len(records) - 1)

    # --- Role-specific advantages (centred per group, no std normalisation).
    if samples:
        adv = role_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                              [s.role for s in samples], [s.group for s in samples])
        for s, a, rec in zip(samples, adv.tolist(), sample_record):
            s.advantage = a
            records[rec].update(advantage=a, trained=True, reward=s.reward)
    for k, (d, a, j) in enumerate(task_of):  # the weights that sampled the answers its reward came from
        versions = {v for c in d.answers[j] for v, _, _ in c.versions}
        records[a.record].update(outcomes=outcomes[k], pass_rate=sum(outcomes[k]) / len(outcomes[k]),
                                 reasoner_group=k in trained_keys,
                                 answer_versions=sorted(versions, key=lambda v: (isinstance(v, str), v)))

    tasks = [a.parsed.task for _, a, _ in task_of]
    stats.update(_statistics(len(docs), [len(d.attempts) for d in docs], [d.group for d in docs], tasks, outcomes,
                             task_reward, samples, reasons, counters, cfg))
    for r in records:  # the audit trail says which challenger wrote each task (a setting: not a metric)
        r["challenger_mode"] = "self" if train_challenger else "model"
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
                    tokenizer=None, rollout_version: int = 0, iteration: int = 0,
                    seed: int | None = None) -> IterationResult:
    """selfplay.challenger=tasks: tasks from a file (task_pool.PoolTask) stand in for the challenger;
    each gets G answers and only the reasoner is trained, centred per question."""
    stats: dict[str, float] = {}
    tasks = [pt.task for pt in pool_tasks]
    answered = answer_tasks(tasks, generate, verifier, cfg, tokenizer, seed, stats)
    samples, records = [], []
    for k, pt in enumerate(pool_tasks):
        records.append({"kind": "task", "iteration": iteration, "doc_id": pt.doc_id, "task": asdict(pt.task),
                        "rollout_version": rollout_version, "outcomes": answered.outcomes[k],
                        "pass_rate": sum(answered.outcomes[k]) / max(1, len(answered.outcomes[k])), "trained": False})
    for (k, c, pred), ok in zip(answered.flat, answered.correct):  # record k is task k's
        records.append({"kind": "reasoner", "iteration": iteration, "doc_id": pool_tasks[k].doc_id, "task_index": k,
                        "challenger_record": k, "rollout_version": rollout_version, "versions": c.versions,
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
    return IterationResult(samples, stats, records)


def _documents_that_fit(documents: Sequence[Document], prompts: ChallengerPrompts, cfg: SelfPlayConfig, tokenizer,
                        context: int) -> tuple[list[Document], list[tuple[Document, str]]]:
    """The documents whose every challenger request fits `context`, and the others with why."""
    from spice_megatron.selfplay.context_budget import EDGE_TOKENS, challenger_overheads

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
    from spice_megatron.selfplay.templates import prompt_token_ids

    prompt = reasoner_prompt(a.parsed.task, cfg.template, tokenizer, cfg.prompt_dir)
    need = len(token_ids(prompt) if token_ids else prompt_token_ids(prompt, tokenizer)) + cfg.reasoner_max_tokens
    if need > context:
        a.parsed = ParseResult(None, "question_over_context", {"tokens": need, "max_model_len": context})


def _challenger_record(doc: Document, a: Attempt, rollout_version: int, iteration: int, grounded: bool = True) -> dict:
    rec = {"kind": "challenger", "iteration": iteration, "doc_id": doc.doc_id, "doc_sha256": doc.sha256,
           "grounded": grounded,  # false: no document grounded the task (selfplay.grounding=none)
           "attempt": a.number, "rollout_version": rollout_version, "versions": a.completion.versions,
           "text": a.completion.text, "valid": a.parsed.valid,
           "reason": a.parsed.reason, "task": asdict(a.parsed.task) if a.parsed.task else None, "trained": False,
           "request_s": [round(t, 3) for t in a.request_s]}  # its request's submit and finish, into the iteration
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
    s["challenger/parse_rate"] = (total_attempts - sum(reasons.values())) / total_attempts if total_attempts else 0.0
    s["tokens/challenger"] = float(counters["tokens/challenger"] + counters["tokens/challenger_selection"])
    if counters["selections"]:
        s["selection_valid_rate"] = counters["selections_valid"] / counters["selections"]
    for reason in (*INVALID_REASONS, *sorted(set(reasons) - set(INVALID_REASONS))):  # every row the same names
        s[f"invalid/{reason}"] = reasons[reason] / total_attempts if total_attempts else 0.0
    # challenger group composition (Algorithm 1: G per document, valid:invalid ratio kept)
    n_docs = n_docs or 1
    s["challenger/group_valid"] = sum(a.parsed.valid for g in groups for a in g) / n_docs
    s["challenger/group_invalid"] = sum(not a.parsed.valid for g in groups for a in g) / n_docs
    s["challenger/groups_without_task"] = float(len(groups) - with_task)
    types = Counter(t.answer_type for t in tasks)
    for answer_type in ANSWER_TYPES:
        s[f"mix/{answer_type}"] = types[answer_type] / len(tasks) if tasks else 0.0
    hist = Counter(sum(o) for o in outcomes)
    for k in range(cfg.group_size + 1):
        s[f"pass_hist/{k}"] = float(hist[k])
    answers = [ok for o in outcomes for ok in o]
    reasoner = [x for x in samples if x.role == REASONER]
    s["reasoner/no_boxed_rate"] = (sum(extract_boxed(x.completion.text) is None for x in reasoner) / len(reasoner)
                                   if reasoner else 0.0)
    s["reasoner/pass_rate"] = sum(answers) / len(answers) if answers else 0.0
    s["challenger/task_reward_mean"] = sum(task_reward) / len(task_reward) if task_reward else 0.0
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
