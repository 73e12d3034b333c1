"""One SPICE iteration's data: documents -> valid tasks -> G answers -> rewards -> samples.

The generate function is the only link to a model: the trainer passes the rollout fleet's, tests
pass a scripted one. Everything here is deterministic given the generator's outputs and `rng`.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from spice_megatron.config import SelfPlayConfig
from spice_megatron.corpus import Document
from spice_megatron.loss import CHALLENGER, REASONER, role_advantages
from spice_megatron.rewards import challenger_reward, reasoner_reward
from spice_megatron.rollout.types import Completion, SamplingSpec
from spice_megatron.tasks import ParseResult, Task, challenger_prompt, extract_boxed, parse_challenger_output, reasoner_prompt
from spice_megatron.verify import AnswerVerifier, answer_key


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
    group: int  # reasoner: the task index; challenger: -1 (one group over the batch)
    doc_id: str


@dataclass
class IterationResult:
    samples: list[Sample]
    stats: dict[str, float]
    records: list[dict]  # the audit trail: every challenger output and reasoner answer


def _pick_reservoir(slot: list, item, seen: int, rng: random.Random) -> None:
    """Keep one uniformly random item of a stream in slot[0] without storing the stream."""
    if seen == 1 or rng.random() < 1.0 / seen:
        slot[:] = [item]


def _round_seed(seed: int | None, attempt: int) -> int | None:
    """A distinct sampling seed per generation call, so that a resumed run samples the same."""
    return None if seed is None else (seed * 1_000_003 + (attempt + 2) * 65_536) % 2**31  # prompt i adds i


def run_iteration(documents: Sequence[Document], generate: GenerateFn, verifier: AnswerVerifier,
                  cfg: SelfPlayConfig, rng: random.Random, tokenizer=None, weights_version: int = 0,
                  iteration: int = 0, seed: int | None = None) -> IterationResult:
    """One iteration's data. `seed` (None: unseeded sampling) makes the engine's sampling
    reproducible for exact resume."""
    stats: dict[str, float] = {}
    records: list[dict] = []
    n_docs = len(documents)

    # --- Challenger: attempts in rounds until each document has a valid task or N are spent.
    t0 = time.perf_counter()
    prompts = [challenger_prompt(d.text, tokenizer, cfg.use_chat_template) for d in documents]
    attempts = [0] * n_docs
    valid_seen, invalid_seen = [0] * n_docs, [0] * n_docs
    chosen_valid: list[list] = [[] for _ in range(n_docs)]
    chosen_invalid: list[list] = [[] for _ in range(n_docs)]
    reasons: Counter = Counter()
    challenger_tokens = 0
    pending = list(range(n_docs))
    while pending:
        # Documents in the same round get the same n, except those near their N budget.
        by_n: dict[int, list[int]] = {}
        for i in pending:
            by_n.setdefault(min(cfg.attempts_per_round, cfg.max_attempts - attempts[i]), []).append(i)
        for n, idx in by_n.items():
            outs = generate([prompts[i] for i in idx], SamplingSpec(
                n=n, temperature=cfg.challenger_temperature, top_p=cfg.top_p, max_tokens=cfg.challenger_max_tokens,
                seed=_round_seed(seed, attempts[idx[0]]), role=CHALLENGER))
            for i, comps in zip(idx, outs):
                for c in comps:
                    attempts[i] += 1
                    challenger_tokens += len(c.token_ids)
                    parsed = parse_challenger_output(c.text)
                    records.append(_challenger_record(documents[i], attempts[i], c, parsed, weights_version, iteration))
                    if parsed.valid:
                        valid_seen[i] += 1
                        _pick_reservoir(chosen_valid[i], (c, parsed, len(records) - 1), valid_seen[i], rng)
                    else:
                        reasons[parsed.reason] += 1
                        invalid_seen[i] += 1
                        _pick_reservoir(chosen_invalid[i], (c, parsed, len(records) - 1), invalid_seen[i], rng)
        pending = [i for i in pending if not chosen_valid[i] and attempts[i] < cfg.max_attempts]
    stats["time/challenger_rollout"] = time.perf_counter() - t0
    stats["tokens/challenger"] = challenger_tokens

    # --- Reasoner: G answers per valid task, without the document.
    t0 = time.perf_counter()
    task_docs = [i for i in range(n_docs) if chosen_valid[i]]
    tasks: list[Task] = [chosen_valid[i][0][1].task for i in task_docs]
    r_prompts = [reasoner_prompt(t, tokenizer, cfg.use_chat_template) for t in tasks]
    answers = generate(r_prompts, SamplingSpec(
        n=cfg.group_size, temperature=cfg.reasoner_temperature, top_p=cfg.top_p, max_tokens=cfg.reasoner_max_tokens,
        seed=_round_seed(seed, -1), role=REASONER)) if tasks else []
    stats["time/reasoner_rollout"] = time.perf_counter() - t0
    stats["tokens/reasoner"] = sum(len(c.token_ids) for comps in answers for c in comps)

    t0 = time.perf_counter()
    flat = [(k, c, extract_boxed(c.text)) for k, comps in enumerate(answers) for c in comps]
    correct = verifier.verify_batch([(pred, tasks[k].answer, tasks[k].answer_type) for k, _, pred in flat])
    stats["time/verify"] = time.perf_counter() - t0

    # --- Rewards.
    outcomes: list[list[bool]] = [[] for _ in tasks]
    keys: list[list[str | None]] = [[] for _ in tasks]
    for (k, _, pred), ok in zip(flat, correct):
        outcomes[k].append(ok)
        keys[k].append(answer_key(pred, tasks[k].answer_type))
    task_reward = [challenger_reward(o, True, cfg.challenger_reward, answers=a, invalid_penalty=cfg.invalid_penalty)
                   for o, a in zip(outcomes, keys)]

    samples: list[Sample] = []
    sample_record: list[int] = []  # audit record index of each sample, to write its advantage back
    for k, i in enumerate(task_docs):
        c, _, rec = chosen_valid[i][0]
        samples.append(Sample(CHALLENGER, prompts[i], c, task_reward[k], 0.0, -1, documents[i].doc_id))
        sample_record.append(rec)
    for i in range(n_docs):
        if not chosen_valid[i] and chosen_invalid[i]:
            c, _, rec = chosen_invalid[i][0]
            samples.append(Sample(CHALLENGER, prompts[i], c, cfg.invalid_penalty, 0.0, -1, documents[i].doc_id))
            sample_record.append(rec)
    for (k, c, pred), ok in zip(flat, correct):
        samples.append(Sample(REASONER, r_prompts[k], c, reasoner_reward(ok), 0.0, k, documents[task_docs[k]].doc_id))
        records.append({"kind": "reasoner", "iteration": iteration, "doc_id": documents[task_docs[k]].doc_id,
                        "task_index": k, "weights_version": weights_version, "text": c.text,
                        "extracted": pred, "correct": ok, "reward": reasoner_reward(ok)})
        sample_record.append(len(records) - 1)

    # --- Role-specific advantages (centred, no std normalisation).
    if samples:
        adv = role_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                              [s.role for s in samples], [s.group for s in samples])
        for s, a, rec in zip(samples, adv.tolist(), sample_record):
            s.advantage = a
            records[rec]["advantage"] = a
            records[rec]["trained"] = True
            records[rec]["reward"] = s.reward
    for k, i in enumerate(task_docs):
        rec = records[chosen_valid[i][0][2]]
        rec["outcomes"] = outcomes[k]
        rec["pass_rate"] = sum(outcomes[k]) / len(outcomes[k])

    stats.update(_statistics(n_docs, attempts, task_docs, tasks, outcomes, task_reward, samples, reasons, cfg))
    return IterationResult(samples, stats, records)


def _challenger_record(doc: Document, attempt: int, c: Completion, parsed: ParseResult, weights_version: int,
                       iteration: int) -> dict:
    return {"kind": "challenger", "iteration": iteration, "doc_id": doc.doc_id, "doc_sha256": doc.sha256,
            "attempt": attempt, "weights_version": weights_version, "text": c.text, "valid": parsed.valid,
            "reason": parsed.reason, "task": asdict(parsed.task) if parsed.task else None, "trained": False}


def _statistics(n_docs: int, attempts: list[int], task_docs: list[int], tasks: list[Task],
                outcomes: list[list[bool]], task_reward: list[float], samples: list[Sample],
                reasons: Counter, cfg: SelfPlayConfig) -> dict[str, float]:
    s: dict[str, float] = {}
    total_attempts = sum(attempts)
    s["valid_task_rate"] = len(task_docs) / n_docs if n_docs else 0.0
    s["attempts_per_doc"] = total_attempts / n_docs if n_docs else 0.0
    s["attempts_per_doc_max"] = float(max(attempts, default=0))
    s["challenger_parse_rate"] = (total_attempts - sum(reasons.values())) / total_attempts if total_attempts else 0.0
    for reason, count in reasons.items():
        s[f"invalid/{reason}"] = count / total_attempts
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
    for role in (CHALLENGER, REASONER):
        adv = torch.tensor([x.advantage for x in samples if x.role == role], dtype=torch.float64)
        rew = [x.reward for x in samples if x.role == role]
        s[f"{role}/samples"] = float(len(rew))
        s[f"{role}/reward_mean"] = sum(rew) / len(rew) if rew else 0.0
        s[f"{role}/advantage_mean"] = adv.mean().item() if adv.numel() else 0.0
        s[f"{role}/advantage_std"] = adv.std(unbiased=False).item() if adv.numel() else 0.0
        s[f"{role}/advantage_abs_max"] = adv.abs().max().item() if adv.numel() else 0.0
    return s
