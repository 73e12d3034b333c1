"""`spice plan`'s seconds per SPICE iteration for a plan, by phase: the rollouts on the plan's
engines (phased or streamed), the learner's forward and steps on its layout, the weight sync and,
colocated, the sleep, wake and offload between them. The terms are costs.py's, from stated
throughput assumptions (`Throughput`): a planning aid, not a measurement."""
from __future__ import annotations

import math

from spice_megatron.config import SpiceConfig
from spice_megatron.families import ModelSpec
from spice_megatron.plan.costs import (
    GiB,
    LearnerWork,
    Throughput,
    all_to_all_seconds,
    decode_phase,
    forward_pass_seconds,
    learner_seconds,
)
from spice_megatron.plan.planner import Plan
from spice_megatron.policy.model import resolve_shared_prefix


def estimate_step_time(plan: Plan, spec: ModelSpec, cfg: SpiceConfig, t: Throughput | None = None) -> dict[str, float]:
    """Seconds per SPICE iteration by phase (the terms: plan/costs.py). A phased iteration's phase
    lasts at least as long as its longest sequence takes at the decode step time, a streamed one's
    rollouts as long as the engines' work or the slowest document's chain of requests (its rounds'
    and answers' longest outputs). The learner runs a forward for the old log-probs, then forward
    and backward, plus the recomputed parameters with train.recompute (full: every layer's;
    selective mlp: the dense MLPs'; moe: the experts a token runs through), per token it runs:
    with train.shared_prefix each group's prompt once."""
    t = t or Throughput.for_gpu(cfg.cluster.gpu)
    sp, lp, en = cfg.selfplay, plan.learner, plan.engines
    p, active = spec.num_parameters, spec.active_parameters
    full_step = [0.0]  # a decode step of an engine running its most sequences (the streamed path's)

    def generate(prompts: float, prompt_tokens: int, gen_tokens: int, max_gen: int) -> tuple[float, float]:
        """A phase's seconds when it waits for its longest sequence (phased), and the engines' busy
        seconds for its sequences alone (what a streamed iteration spends on them)."""
        phased, busy, step = decode_phase(spec, en.tp, en.count, en.memory.max_sequences,
                                          en.memory.kv_bytes_per_token, cfg.rollout.max_model_len, prompts,
                                          prompt_tokens, gen_tokens, max_gen, t, cfg.cluster.gpus_per_node)
        full_step[0] = max(full_step[0], step)
        return phased, busy

    docs = sp.batch_docs
    challenger, pending, work = 0.0, float(docs), 0.0
    path_tokens = 0.0  # the slowest document's way: its rounds' and its answers' longest outputs, one after another
    for _ in range(t.challenger_rounds):
        attempts = pending * sp.attempts_per_round
        if sp.protocol == "paper":
            phased, busy = generate(attempts, t.doc_tokens, t.selection_gen_tokens, sp.selection_max_tokens)
            challenger, work = challenger + phased, work + busy
            path_tokens += expected_longest(t.selection_gen_tokens, sp.selection_max_tokens, sp.attempts_per_round)
            attempts *= t.selection_valid_rate
        phased, busy = generate(attempts, t.doc_tokens, t.challenger_gen_tokens, sp.challenger_max_tokens)
        challenger, work = challenger + phased, work + busy
        path_tokens += expected_longest(t.challenger_gen_tokens, sp.challenger_max_tokens,
                                        1 if sp.protocol == "paper" else sp.attempts_per_round)
        pending = max(1.0, pending * t.pending_after_round)
    answers = docs * sp.group_size  # the G answers of one task per document
    reasoner, busy = generate(answers, t.question_tokens, t.reasoner_gen_tokens, sp.reasoner_max_tokens)
    work += busy
    path_tokens += expected_longest(t.reasoner_gen_tokens, sp.reasoner_max_tokens, sp.group_size)
    # streamed (run.streamed): no phase waits for the batch's longest sequence; the rollouts last as
    # long as the engines' work or the slowest document's own chain of requests, whichever is longer
    streamed = max(work, path_tokens * full_step[0])
    challenger_trained = docs * (sp.group_size if sp.challenger_group == "document" else 1)
    train_tokens = (challenger_trained * (t.doc_tokens + t.challenger_gen_tokens)
                    + answers * (t.question_tokens + t.reasoner_gen_tokens))
    learner_tokens = train_tokens
    if resolve_shared_prefix(spec, cfg.train, lp.cp).use_shared_prefix:  # the plan's CP (--choose may add it)
        prompts = 1.0 if sp.protocol == "compact" else t.paper_challenger_prompts
        challenger_prompts = docs * min(prompts, sp.group_size) if sp.challenger_group == "document" \
            else challenger_trained
        learner_tokens = (challenger_prompts * t.doc_tokens + challenger_trained * t.challenger_gen_tokens
                          + docs * t.question_tokens + answers * t.reasoner_gen_tokens)
    recomputed = 0.0
    recompute = lp.recompute
    if recompute == "full":
        recomputed = active
    elif recompute == "selective":
        modules, moe = cfg.train.recompute_modules, spec.moe
        dense_layers = spec.num_layers - (moe.num_moe_layers if moe else 0)
        if "mlp" in modules:
            recomputed += dense_layers * 3 * spec.hidden_size * spec.ffn_hidden_size
        if moe is not None and "moe" in modules:  # the routed and shared experts a token runs through
            expert = moe.top_k * moe.expert_ffn_hidden_size + moe.shared_expert_ffn_hidden_size
            recomputed += moe.num_moe_layers * 3 * spec.hidden_size * expert
        # moe_act recomputes an activation, no matmul: nothing counted
    per_update = cfg.train.trajectories_per_update
    steps = math.ceil((challenger_trained + answers) / per_update) if per_update else cfg.train.steps_per_batch
    work_done = LearnerWork(tokens=learner_tokens, mean_row_tokens=train_tokens / (challenger_trained + answers),
                            forwards=1, recomputed_params=recomputed, full_recompute=recompute == "full",
                            micro_batches=learner_tokens / steps / cfg.train.micro_batch_tokens / lp.dp, steps=steps,
                            moe_recompute=recompute == "selective" and "moe" in cfg.train.recompute_modules)
    learner = learner_seconds(spec, work_done, lp.memory.weights, lp.gpus, lp.tp, lp.pp, lp.dp,
                              cfg.cluster.gpus_per_node, t, vpp=lp.vpp, cp=lp.cp)
    train = sum(learner.values())
    if lp.memory.all_to_all_gib:
        train += all_to_all_seconds(learner_tokens / cfg.train.micro_batch_tokens / lp.dp,
                                    lp.memory.all_to_all_gib, work_done,
                                    lp.ep * cfg.parallel.expert_tensor_parallel <= cfg.cluster.gpus_per_node, t)
    if lp.optimizer_offload:  # the CPU's share of every optimizer step
        offloaded = lp.optimizer_offload * p / lp.gpus  # parameters per GPU updated on the host
        train += steps * offloaded / t.cpu_adam_params_per_s
    rollout = streamed if cfg.run.streamed else challenger + reasoner
    hidden = 0.0
    if cfg.old_logprobs_during_rollouts and not plan.colocated:
        # the old-log-prob forward (one of the learner's 4 passes) runs while documents still
        # roll out: hidden but for the last documents' share (taken as one in B)
        forward = forward_pass_seconds(spec, work_done, lp.gpus, t)
        hidden = min(forward * (1 - 1 / docs), rollout)
        train -= hidden
    out = {"rollout": rollout, "train": train}
    if plan.colocated:
        out["weight_sync"] = 2 * p / (t.ipc_gb_s * 1e9) + 1.0
        # engines' weights to the host and back (sleep level 1; level 2 drops them: the sync refills),
        # the learner's optimizer state out and in (its gradient buffers are freed, not copied)
        moved = (2 * en.memory.weights if cfg.rollout.sleep_level == 1 else 0.0) + 2 * lp.memory.optimizer
        out["sleep_wake_offload"] = moved * GiB / (t.host_gb_s * 1e9) + 2.0
    else:
        out["weight_sync"] = 2 * p / lp.pp / (t.sync_gb_s * 1e9) + 1.0  # + the engines' in-place load
    out["total"] = sum(out.values())
    # the phases as a phased iteration has them (run.streamed=false), and both schedules' rollouts
    out.update(challenger_rollout=challenger, reasoner_rollout=reasoner, rollout_phased=challenger + reasoner,
               rollout_streamed=streamed, old_logprobs_during_rollouts=hidden)
    out.update({f"train_{term}": seconds for term, seconds in learner.items()})  # within train
    out["train_tokens"] = float(train_tokens)
    out["learner_tokens"] = float(learner_tokens)
    # NeMo-RL's throughput unit: tokens (prompt + generated) through the loop per second per GPU of
    # the job; one step off, the rollouts overlap the learner's step and sync (not colocated: the
    # engines sleep while the learner steps)
    out["tokens_per_s_per_gpu"] = train_tokens / out["total"] / plan.gpus
    out["tokens_per_s_per_gpu_one_step_off"] = 0.0 if plan.colocated else \
        train_tokens / max(rollout, train + out["weight_sync"]) / plan.gpus
    return out


def expected_longest(mean: float, cap: int, n: int) -> float:
    """The expected longest of n outputs: lengths taken as exponential with `mean` (RL outputs have a
    long tail) and cut at the max tokens, so the longest of n is about mean x H(n), at most `cap`.
    A round of a whole batch (hundreds of outputs) reaches the cap; one document's 8 often do not."""
    return min(float(cap), mean * sum(1.0 / k for k in range(1, max(1, int(n)) + 1)))


# NeMo-RL's published GRPO throughput, Llama-3.1-8B-Instruct on 2 nodes of 8 H100s (its performance
# summary): the figures `spice plan` prints beside its own estimate
NEMO_RL_TOKENS_PER_S_PER_GPU = {"synchronous": 1581.0, "one step off": 2478.0}
