"""The challenger measured as the paper's Figure 3 measures it: fixed documents, a fixed reasoner.

A challenger's reward on its training documents follows the documents drawn as much as the
challenger; holding the documents and the reasoner fixed leaves the challenger as the only thing
that changes. Two halves, because the challenger and the fixed reasoner are different weights:
`write_tasks` runs on the challenger's engine (during training: the trainer's evaluation hook on
the training fleet, `spice train --eval-challenger-docs`), `score_tasks` on the fixed reasoner's,
once for every evaluation of a run. `spice coevolution` uses the same two over checkpoints.

Per document, over its G attempts (an invalid task counts as an attempt that scored nothing):
valid rate, gold-right rate (where the caller knows the document's answer), frontier share (valid
tasks the fixed reasoner solves sometimes, 0 < pass rate < 1) and the variance reward (SPICE's
challenger reward of a valid task, 0 for an invalid one). Comparisons are paired over documents.
"""
from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import asdict
from typing import Callable, Sequence

from spice_megatron.selfplay.rewards import at_frontier, variance_reward

METRICS = ("valid_rate", "gold_right", "frontier_share", "variance_reward")


def encoded_generate(fleet, tokenizer):
    """The fleet's generate on token ids, by the training rule (templates.prompt_token_ids)."""
    from spice_megatron.selfplay.templates import prompt_token_ids

    return lambda prompts, spec: fleet.generate([prompt_token_ids(p, tokenizer) for p in prompts], spec)


def write_tasks(generate, docs: Sequence, tokenizer, cfg, seed: int, attempts: int) -> list[dict]:
    """Per document: its id and `attempts` attempts written as in training (the recipe's protocol,
    prompts and template): each a task dict, or None with the reason it is invalid."""
    from spice_megatron.selfplay.doc_rollout import challenger_round
    from spice_megatron.selfplay.protocol import ChallengerPrompts

    prompts = ChallengerPrompts(cfg.template, tokenizer, cfg.prompt_dir, cfg.grounding == "document")
    rounds = challenger_round(list(docs), attempts, generate, prompts, cfg, seed, Counter())
    return [{"doc_id": d.doc_id, "tasks": [asdict(a.parsed.task) if a.parsed.valid else None for a in tried],
             "reasons": [a.parsed.reason for a in tried]} for d, tried in zip(docs, rounds)]


def valid_tasks(written: list[dict]) -> list:
    """The valid tasks of write_tasks' records, as Task objects, in order."""
    from spice_megatron.tasks import Task

    return [Task(**{**t, "options": tuple(t.get("options") or ())}) for rec in written for t in rec["tasks"]
            if t is not None]


def score_tasks(generate, written: list[dict], tokenizer, cfg, verifier, seed: int,
                gold: Callable[[str], str | None] | None = None) -> list[dict]:
    """The fixed reasoner's G answers (cfg.group_size, the training sampling) to every valid task of
    `written`; per document its attempts' pass rates (None: invalid) and the metrics."""
    from spice_megatron.selfplay.iteration import answer_tasks

    tasks = valid_tasks(written)
    outcomes = iter(answer_tasks(tasks, generate, verifier, cfg, tokenizer, seed, {}).outcomes if tasks else [])
    scored = []
    for rec in written:
        expected = gold(rec["doc_id"]) if gold is not None else None
        rates, rewards, frontier, right = [], [], [], []
        for t in rec["tasks"]:
            if t is None:
                rates.append(None)
                rewards.append(0.0)
                frontier.append(False)
                right.append(False)
                continue
            o = next(outcomes)
            rates.append(sum(o) / len(o))
            rewards.append(variance_reward(o))
            frontier.append(at_frontier(o))
            right.append(expected is not None and t["answer"].strip().replace(",", "") == expected)
        n = len(rec["tasks"]) or 1
        scored.append({"doc_id": rec["doc_id"], "pass_rates": rates,
                       "valid_rate": sum(r is not None for r in rates) / n,
                       "gold_right": sum(right) / n if expected is not None else float("nan"),
                       "frontier_share": sum(frontier) / n, "variance_reward": sum(rewards) / n})
    return scored


def summarise(scored: list[dict]) -> dict:
    """Means over documents, and the fixed reasoner's pass-rate histogram over valid tasks (tenths)."""
    out = {k: _mean([d[k] for d in scored]) for k in METRICS}
    rates = [r for d in scored for r in d["pass_rates"] if r is not None]
    out["pass_rate_histogram"] = [sum(min(int(r * 10), 9) == b for r in rates) for b in range(10)]
    out["documents"] = len(scored)
    return out


def _mean(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return sum(kept) / len(kept) if kept else float("nan")


def paired_bootstrap(a: list[float], b: list[float], resamples: int = 4000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """mean(a - b) over paired items and its percentile bootstrap interval (items resampled)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_bootstrap: {len(a)} and {len(b)} items; they must be paired and not empty")
    diffs = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(resamples))
    tail = (1 - level) / 2
    return sum(diffs) / len(diffs), means[int(tail * resamples)], means[min(resamples - 1, int((1 - tail) * resamples))]


def challenger_eval_hook(docs: Sequence, out_dir: str, tokenizer, cfg, seed: int, attempts: int):
    """The trainer's evaluation hook for the challenger: every evaluation, the current policy
    writes `attempts` tasks per fixed document into out_dir/iteration_NNNN.json (scored later
    against a fixed reasoner); returns the valid rate, logged as eval/challenger_heldout_valid_rate."""
    os.makedirs(out_dir, exist_ok=True)

    def hook(iteration: int, fleet) -> dict[str, float]:
        written = write_tasks(encoded_generate(fleet, tokenizer), docs, tokenizer, cfg, seed, attempts)
        path = os.path.join(out_dir, f"iteration_{iteration:04d}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"iteration": iteration, "seed": seed, "attempts": attempts, "documents": written}, f)
        os.replace(path + ".tmp", path)
        valid = [t is not None for rec in written for t in rec["tasks"]]
        return {"challenger_heldout_valid_rate": sum(valid) / max(len(valid), 1)}

    return hook


def read_documents(path: str) -> list:
    """Fixed documents from a JSONL file of {"text": ...} records (an optional "doc_id"); the error
    names the line that is not one."""
    import hashlib

    from spice_megatron.data.corpus import Document

    docs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                text = rec["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a JSON record with a text field ({e})") from None
            doc_id = str(rec.get("doc_id", f"fixed/{n - 1}/0"))
            docs.append(Document(doc_id=doc_id, text=text, source="fixed", record_index=n - 1, segment_index=0,
                                 sha256=hashlib.sha256(text.encode()).hexdigest(), num_tokens=0, file=path))
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs
