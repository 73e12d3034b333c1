"""Analysis of SPICE runs: training curves from metrics.jsonl, and co-evolution (paper fig. 3).

Co-evolution, on a fixed pool of documents: each challenger checkpoint writes tasks, which a fixed
reasoner answers G times (does the challenger get harder?); a fixed challenger's tasks are answered
by each reasoner checkpoint (does the reasoner get better?). Each checkpoint is served by its own
rollout engine in turn.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import asdict, dataclass

import matplotlib

matplotlib.use("Agg")  # files only; no display on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from spice_megatron.eval.challenger_eval import encoded_generate, valid_tasks, write_tasks  # noqa: E402
from spice_megatron.eval.harness import json_safe  # noqa: E402
from spice_megatron.metric_names import CURVES  # noqa: E402

log = logging.getLogger(__name__)

def read_metrics(path: str) -> list[dict]:
    """Rows of a metrics.jsonl; a torn last line (a killed run) is skipped with a warning."""
    from spice_megatron.metric_names import current_names
    from spice_megatron.run.log import read_jsonl

    return [current_names(r) for r in read_jsonl(path, warn=log.warning)]


def plot_training_curves(metrics_path: str, out_png: str) -> str:
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path}: no metrics to plot")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, CURVES):
        for key in keys:
            pts = [(r["iteration"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole
        if len(keys) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))  # the run's name, not a path
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


# ------------------------------------------------------------------------------------------ co-evolution


@dataclass
class PassRate:
    checkpoint: str
    tasks: int  # tasks answered (valid tasks of the challenger in question)
    answers: int
    correct: int
    valid_task_rate: float = float("nan")  # for challenger checkpoints

    @property
    def pass_rate(self) -> float:
        return self.correct / self.answers if self.answers else float("nan")


def _challenger_tasks(fleet, docs, tokenizer, cfg, seed: int, attempts: int) -> tuple[list, float]:
    """The valid tasks of `attempts` challenger attempts per document, written as in training: the
    recipe's protocol (the paper's selection + generation, or compact), prompts and template."""
    written = write_tasks(encoded_generate(fleet, tokenizer), docs, tokenizer, cfg, seed, attempts)
    tasks = valid_tasks(written)
    return tasks, len(tasks) / (len(docs) * attempts) if docs else float("nan")


def _answer(fleet, tasks, tokenizer, cfg, verifier, seed: int) -> tuple[int, int]:
    """G answers per task, as the reasoner's training rollouts (prompts, stop strings, lengths)."""
    from spice_megatron.selfplay.iteration import answer_tasks

    if not tasks:
        return 0, 0
    answered = answer_tasks(tasks, encoded_generate(fleet, tokenizer), verifier, cfg, tokenizer, seed, {})
    return len(answered.correct), sum(answered.correct)


def coevolution(checkpoints: list[str], docs, selfplay_cfg, out_dir: str, fixed_reasoner: str | None = None,
                fixed_challenger: str | None = None, seed: int = 1234, kv_cache_gib: float = 1.0,
                max_model_len: int = 4096, attempts: int = 128) -> dict:
    """Pass rates of a fixed reasoner against each challenger checkpoint, and of each reasoner
    checkpoint against a fixed challenger (defaults: the first checkpoint for both). Each challenger
    makes `attempts` attempts per document (the paper's 128)."""
    from transformers import AutoTokenizer

    from spice_megatron.rollout.local import local_fleet
    from spice_megatron.selfplay.verify import AnswerVerifier

    fixed_reasoner = fixed_reasoner or checkpoints[0]
    fixed_challenger = fixed_challenger or checkpoints[0]
    # the fixed challenger first: its tasks are answered by every checkpoint as it is served
    order = [fixed_challenger] + [c for c in checkpoints if c != fixed_challenger]
    tasks: dict[str, list] = {}
    valid: dict[str, float] = {}
    reasoners: dict[str, PassRate] = {}
    by_fixed_reasoner: dict[str, tuple[int, int]] = {}  # challenger checkpoint -> (answers, correct)
    logs = os.path.join(out_dir, "logs")
    verifier = AnswerVerifier(processes=1)

    def serve(ckpt: str):
        return AutoTokenizer.from_pretrained(ckpt), local_fleet(ckpt, logs, max_model_len, kv_cache_gib, seed)

    try:
        for ckpt in order:
            tok, served = serve(ckpt)
            with served as fleet:
                tasks[ckpt], valid[ckpt] = _challenger_tasks(fleet, docs, tok, selfplay_cfg, seed, attempts)
                if ckpt in checkpoints:
                    n, k = _answer(fleet, tasks[fixed_challenger], tok, selfplay_cfg, verifier, seed)
                    reasoners[ckpt] = PassRate(ckpt, len(tasks[fixed_challenger]), n, k)
                if ckpt == fixed_reasoner:
                    by_fixed_reasoner.update({c: _answer(fleet, tasks[c], tok, selfplay_cfg, verifier, seed)
                                              for c in tasks if c in checkpoints})
        pending = [c for c in checkpoints if c not in by_fixed_reasoner]
        if pending:  # challengers served after the fixed reasoner: serve it once more for their tasks
            tok, served = serve(fixed_reasoner)
            with served as fleet:
                by_fixed_reasoner.update({c: _answer(fleet, tasks[c], tok, selfplay_cfg, verifier, seed)
                                          for c in pending})
    finally:
        verifier.close()
    challengers = {c: PassRate(c, len(tasks[c]), *by_fixed_reasoner[c], valid[c]) for c in checkpoints}
    result = {"fixed_reasoner": fixed_reasoner, "fixed_challenger": fixed_challenger, "documents": len(docs),
              "attempts_per_document": attempts, "group_size": selfplay_cfg.group_size,
              "protocol": selfplay_cfg.protocol, "template": selfplay_cfg.template,
              "fixed_reasoner_vs_challengers": [dict(asdict(challengers[c]), pass_rate=challengers[c].pass_rate)
                                                for c in checkpoints],
              "reasoners_vs_fixed_challenger": [dict(asdict(reasoners[c]), pass_rate=reasoners[c].pass_rate)
                                                for c in checkpoints]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "coevolution.json"), "w") as f:
        json.dump(json_safe(result), f, indent=2, allow_nan=False)
    result["png"] = plot_coevolution(result, os.path.join(out_dir, "coevolution.png"))
    return result


def plot_coevolution(result: dict, out_png: str) -> str:
    labels = [os.path.basename(os.path.normpath(r["checkpoint"])) for r in result["fixed_reasoner_vs_challengers"]]
    x = list(range(len(labels)))
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, label in (("fixed_reasoner_vs_challengers",
                        f"fixed reasoner ({os.path.basename(result['fixed_reasoner'])}) "
                                                         "vs challenger checkpoints"),
                       ("reasoners_vs_fixed_challenger", f"reasoner checkpoints vs fixed challenger "
                                                         f"({os.path.basename(result['fixed_challenger'])})")):
        ys = [100 * r["pass_rate"] if r["answers"] else float("nan") for r in result[key]]
        ax.plot(x, ys, marker="o", label=label)
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel("pass rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"co-evolution on {result['documents']} fixed documents x {result['attempts_per_document']} attempts "
                 f"(G={result['group_size']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def fixed_documents(corpus_cfg, tokenizer, count: int, seed: int, recipe: str = "") -> list:
    """The same `count` documents of the training corpus (staged for `recipe`) for every checkpoint."""
    from spice_megatron.data.corpus import Corpus

    corpus = Corpus.build(corpus_cfg, tokenizer, recipe)
    docs = list(corpus.documents)
    random.Random(seed).shuffle(docs)
    return docs[:count]
