"""The metrics contract: every name a run writes to metrics.jsonl, TensorBoard and W&B, with its
meaning, unit and group. One spelling everywhere: metrics.jsonl, TensorBoard's tags and W&B's keys are
the same names. The end-of-run summary, `spice curves`, the kill
switch and the glossary in docs/metrics.md (tools/docs_tables.py) all draw from here.

A name with `{...}` is a family (one name per answer type, layer, benchmark...). Names that an older
run wrote are read through RENAMED, so its curves and checks still work.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from spice_megatron.tasks import ANSWER_TYPES, INVALID_REASONS


@dataclass(frozen=True)
class Metric:
    name: str
    meaning: str
    unit: str
    group: str
    only: str = ""  # written only by runs of this kind (colocate, moe, eval, selection); "" every run


_M = Metric
METRICS: tuple[Metric, ...] = (
    # the self-play iteration: what the challenger wrote and how the reasoner did
    _M("iteration", "the training iteration this row is about, counted from 1", "count", "run"),
    _M("weights_version", "the policy version after this iteration's update (the engines serve it next), from 1",
       "count", "run"),
    _M("rollout_version", "the policy version that generated this iteration's rollouts (0: the base model; "
       "as the audit trail names it)",
       "count", "staleness"),
    _M("valid_task_rate", "documents with at least one valid task / documents drawn; the kill switch's "
       "run.min_valid_task_rate reads it", "fraction", "challenger"),
    _M("attempts_per_doc", "challenger attempts per document (resampling until a valid task)", "count", "challenger"),
    _M("attempts_per_doc_max", "the most attempts any document took", "count", "challenger"),
    _M("challenger/parse_rate", "challenger attempts that parsed into a valid task / attempts", "fraction",
       "challenger"),
    _M("challenger/task_reward_mean", "mean variance reward of the valid tasks (the paper's challenger reward: "
       "high when the reasoner passes about half its answers)", "reward", "challenger"),
    _M("challenger/reward_mean", "mean reward over every challenger sample, invalid ones at the penalty; the kill "
       "switch's run.min_challenger_reward reads it", "reward", "challenger"),
    _M("challenger/frontier_share", "valid tasks whose reasoner pass rate is strictly between 0 and 1", "fraction",
       "challenger"),
    _M("challenger/leak_rate", "valid tasks whose answer stands in their question", "fraction", "challenger"),
    _M("challenger/group_valid", "valid challenger samples per document", "count", "challenger"),
    _M("challenger/group_invalid", "invalid challenger samples per document", "count", "challenger"),
    _M("challenger/groups_without_task", "documents of the iteration with no valid task", "count", "challenger"),
    _M("selection_valid_rate", "selection passes (challenger.selection) that named a valid task / passes",
       "fraction", "challenger", "selection"),
    _M("invalid/{reason}", "challenger attempts invalid for this reason / attempts (every reason of "
       "tasks.INVALID_REASONS, 0 when none)", "fraction", "challenger"),
    _M("mix/{answer_type}", "valid tasks of this answer type / valid tasks", "fraction", "challenger"),
    _M("skipped/prompt_too_long", "documents whose challenger prompt would not fit rollout.max_model_len",
       "count", "challenger"),
    _M("reasoner/pass_rate", "correct reasoner answers / answers, over the valid tasks", "fraction", "reasoner"),
    _M("reasoner/no_boxed_rate", "reasoner answers with no \\boxed{} answer / answers", "fraction", "reasoner"),
    _M("reasoner/reward_mean", "mean reward over every reasoner sample trained (1 correct, 0 not)", "reward",
       "reasoner"),
    _M("pass_hist/{k}", "valid tasks whose reasoner group got exactly k answers right (k = 0..G)", "count",
       "reasoner"),
    _M("{role}/samples", "this role's samples in the batch", "count", "advantages"),
    _M("{role}/advantage_mean", "mean DrGRPO advantage of this role's samples (0 by construction per group)",
       "advantage", "advantages"),
    _M("{role}/advantage_std", "standard deviation of this role's advantages", "advantage", "advantages"),
    _M("{role}/advantage_abs_max", "largest |advantage| of this role", "advantage", "advantages"),
    _M("{role}/nonzero_advantage_rate", "this role's samples with a non-zero advantage (the others add no "
       "gradient)", "fraction", "advantages"),
    # the learner's update
    _M("train/loss", "DrGRPO loss of the iteration's update (the mean over its optimiser steps)", "loss", "train"),
    _M("train/grad_norm", "gradient norm before clipping (the largest over the steps)", "norm", "train"),
    _M("train/lr", "learning rate of the last step", "lr", "train"),
    _M("train/steps", "optimiser steps in the iteration (train.trajectories_per_update)", "count", "train"),
    _M("train/tokens", "generated tokens trained on", "tokens", "train"),
    _M("train/tokens_run", "tokens through the forward (shared prompts once; fillers and padding aside)",
       "tokens", "train"),
    _M("train/sequences", "sequences in the update (DrGRPO's normaliser)", "count", "train"),
    _M("train/trained_sequences", "of them, those with a non-zero advantage", "count", "train"),
    _M("train/clip_fraction", "tokens whose ratio was clipped", "fraction", "train"),
    _M("train/approx_kl", "k3 estimate of KL(old || new) over the trained tokens", "nats", "train"),
    _M("train/seconds", "seconds in the learner's steps", "s", "train"),
    _M("train/logprob_gap", "mean |learner - engine| log-prob of the sampled tokens: the train-vs-rollout gap "
       "(near 0 when the sync is right)", "nats", "train"),
    _M("train/{role}/logprob_gap_mean", "the gap over this role's tokens", "nats", "train"),
    _M("train/{role}/logprob_gap_max", "the largest gap over this role's tokens", "nats", "train"),
    _M("train/{role}/k3_kl", "k3 KL between engine and learner over this role's tokens", "nats", "train"),
    _M("train/{role}/tis_capped", "this role's tokens whose importance weight hit train.tis_cap", "fraction",
       "train"),
    _M("train/routing_differs", "(token, MoE layer) pairs where the learner's top-k differs from the engine's",
       "fraction", "train", "moe"),
    _M("train/router/max_load/{layer}", "the busiest expert's tokens / the mean expert's, per MoE layer", "ratio",
       "train", "moe"),
    _M("train/router/entropy/{layer}", "mean router entropy per token, per MoE layer", "nats", "train", "moe"),
    _M("train/old_logprobs_forwards_during_rollouts", "old-log-prob forwards run while rollouts streamed in",
       "count", "train"),
    _M("train/old_logprobs_precomputed", "sequences whose old log-probs were ready when the update began",
       "count", "train"),
    _M("staleness/{role}_lag_mean", "learner version minus the version that generated the sequence, mean",
       "versions", "staleness"),
    _M("staleness/{role}_lag_max", "the same, the largest", "versions", "staleness"),
    # the weight sync
    _M("weight_sync/seconds", "seconds to send the new weights to every engine", "s", "weight_sync"),
    _M("weight_sync/bytes", "bytes sent to each engine", "bytes", "weight_sync"),
    _M("weight_sync/retries", "sync attempts beyond the first", "count", "weight_sync"),
    # throughput and time
    _M("tokens/challenger", "tokens the challenger generated (selection passes included)", "tokens", "throughput"),
    _M("tokens/reasoner", "tokens the reasoner generated", "tokens", "throughput"),
    _M("tokens_per_s/challenger", "challenger tokens / its rollout seconds", "tokens/s", "throughput"),
    _M("tokens_per_s/reasoner", "reasoner tokens / its rollout seconds", "tokens/s", "throughput"),
    _M("tokens_per_s/train", "trained tokens / the learner's seconds", "tokens/s", "throughput"),
    _M("time/challenger_rollout", "seconds of challenger generation", "s", "time"),
    _M("time/reasoner_rollout", "seconds of reasoner generation", "s", "time"),
    _M("time/rollouts", "seconds from the first request to the last answer", "s", "time"),
    _M("time/verify", "seconds checking answers (Math-Verify)", "s", "time"),
    _M("time/wait_for_rollouts", "seconds the learner waited for rollouts (one step off: after its own step)",
       "s", "time"),
    _M("time/old_logprobs_during_rollouts", "seconds of old-log-prob forwards run while rollouts streamed", "s",
       "time"),
    _M("time/train", "seconds of the update", "s", "time"),
    _M("time/iteration", "seconds of the whole iteration", "s", "time"),
    _M("time/elapsed", "seconds since the run (or its resume) started", "s", "time"),
    _M("time/engines_sleep", "seconds putting the engines to sleep before the update", "s", "time", "colocate"),
    _M("time/engines_wake", "seconds waking the engines after it", "s", "time", "colocate"),
    _M("time/learner_offload", "seconds moving the learner's state off the GPU for the rollouts", "s", "time",
       "colocate"),
    _M("time/learner_reload", "seconds moving it back", "s", "time", "colocate"),
    _M("colocate/engine_gib_freed", "GiB the sleeping engines gave back", "GiB", "colocate", "colocate"),
    # evaluation (run.eval_every)
    _M("eval/{benchmark}", "held-out accuracy on this benchmark (spice train --eval-benchmarks); written from "
       "the first evaluation on, null between evaluations", "fraction", "eval", "eval"),
    _M("eval/overall_average", "the mean over the benchmarks evaluated", "fraction", "eval", "eval"),
    _M("time/eval", "seconds of the evaluation", "s", "time", "eval"),
)

# names an older run wrote -> today's (two names a separator apart meant different things)
RENAMED = {"challenger_reward_mean": "challenger/task_reward_mean", "reasoner_pass_rate": "reasoner/pass_rate",
           "challenger_parse_rate": "challenger/parse_rate", "reasoner_no_boxed_rate": "reasoner/no_boxed_rate"}
DROPPED = ("challenger_mode", "rollout/streamed")  # settings, not measurements: RUN/config.json has them

# what the end of a run prints, and `spice curves`' panels
SUMMARY = ("weights_version", "valid_task_rate", "attempts_per_doc", "reasoner/pass_rate",
           "challenger/task_reward_mean", "train/loss", "train/grad_norm", "train/logprob_gap", "weight_sync/seconds",
           "time/iteration")
CURVES = (("valid-task rate", ("valid_task_rate",)), ("reasoner pass rate", ("reasoner/pass_rate",)),
          ("rewards", ("challenger/task_reward_mean", "challenger/reward_mean", "reasoner/reward_mean")),
          ("loss", ("train/loss",)), ("train-vs-rollout log-prob gap", ("train/logprob_gap",)),
          ("seconds per phase", ("time/challenger_rollout", "time/reasoner_rollout", "time/verify", "time/train",
                                 "weight_sync/seconds")))
# the kill switch's readings (run.min_valid_task_rate, run.min_challenger_reward)
VALID_TASK_RATE, CHALLENGER_REWARD = "valid_task_rate", "challenger/reward_mean"
ROLES = ("challenger", "reasoner")


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\\\{\w+\\\}", r"[^/]+", re.escape(name)) + "$")


_PATTERNS = [(_pattern(m.name), m) for m in METRICS]


def describe(name: str) -> Metric | None:
    """The contract's entry for a name a run wrote (a family's entry for its members)."""
    for pattern, m in _PATTERNS:
        if pattern.match(name):
            return m
    return None


def current_names(row: dict) -> dict:
    """A metrics row with an older run's names read as today's."""
    return {RENAMED.get(k, k): v for k, v in row.items() if k not in DROPPED}


def run_kinds(cfg) -> set[str]:
    """Which of the contract's optional names a run of this SpiceConfig writes (MoE's are measured
    from the first step, so they need no declaring)."""
    kinds = {"colocate"} if cfg.run.colocate else set()
    if cfg.run.eval_every:
        kinds.add("eval")
    if cfg.selfplay.protocol == "paper" and cfg.selfplay.challenger != "tasks":
        kinds.add("selection")
    return kinds


def declared_names(group_size: int, kinds: set[str]) -> list[str]:
    """Every name a run of these kinds writes in every row (families expanded; eval benchmarks and
    MoE layers are known only once measured, and the logger adds them from then on)."""
    out = []
    for m in METRICS:
        if m.only and m.only not in kinds or m.name in ("iteration", "eval/{benchmark}"):
            continue
        if "{layer}" in m.name:
            continue
        names = [m.name]
        for field, values in (("{role}", ROLES), ("{answer_type}", ANSWER_TYPES), ("{reason}", INVALID_REASONS),
                              ("{k}", [str(k) for k in range(group_size + 1)])):
            if field in m.name:
                names = [n.replace(field, v) for n in names for v in values]
        out += names
    return out


def twins(names: list[str]) -> list[tuple[str, str]]:
    """Pairs of names that differ only by separators ('_', '/', '-'): what a reader confuses."""
    seen: dict[str, str] = {}
    pairs = []
    for n in names:
        key = re.sub(r"[_/\-]", "", n)
        if key in seen and seen[key] != n:
            pairs.append((seen[key], n))
        seen.setdefault(key, n)
    return pairs


def glossary_table() -> str:
    """docs/metrics.md's table (tools/docs_tables.py)."""
    rows = ["| name | group | unit | meaning | written |", "|---|---|---|---|---|"]
    for m in METRICS:
        written = {"": "every run", "colocate": "colocated runs", "moe": "MoE models", "eval": "run.eval_every > 0",
                   "selection": "selfplay.protocol=paper"}[m.only]
        rows.append(f"| `{m.name}` | {m.group} | {m.unit} | {m.meaning.replace('|', '/')} | {written} |")
    renamed = ", ".join(f"`{a}` -> `{b}`" for a, b in RENAMED.items())
    rows.append("")
    rows.append(f"Renamed (older runs are read with today's names): {renamed}. Dropped (settings, in "
                f"`RUN/config.json`): {', '.join(f'`{d}`' for d in DROPPED)}.")
    return "\n".join(rows)
