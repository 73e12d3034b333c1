"""The planner against NeMo-RL's published GRPO throughput: its rollout and learner terms
(`costs.py`, the ones every recipe is planned with) applied to the layouts and workloads
NeMo-RL published for H100s, side by side with the published tokens/s/GPU.

Source: NVIDIA-NeMo/RL `docs/about/performance-summary.md` (v0.5 and v0.6 tables; tokens/s/GPU is
(prompt + generated tokens of every sequence) / step time / GPUs, the unit `spice plan` prints),
settings from its `examples/configs/recipes/llm/performance/*.yaml` and their defaults
(`grpo_math_1B.yaml`): synchronous GRPO, colocated (generation on the training GPUs, vLLM at
gpu_memory_utilization 0.6), a KL penalty to a reference model (so two forward-only passes, the
previous and the reference policy's log-probs, before the update), one sequence per micro-batch,
OpenMathInstruct-2 prompts."""
from __future__ import annotations

from dataclasses import dataclass

from spice_megatron.config import ParallelConfig, PolicyTrainConfig
from spice_megatron.plan.costs import GiB, LearnerWork, Throughput, all_to_all_seconds, decode_phase, learner_seconds
from spice_megatron.plan.memory import engine_memory, learner_memory
from spice_megatron.plan.planner import model_spec
from spice_megatron.policy.activation_memory import activation_flags

NEMO_RL_ENGINE_MEMORY_UTILIZATION = 0.6  # grpo_math_1B.yaml: vllm_cfg.gpu_memory_utilization
PROMPT_TOKENS = 150  # an OpenMathInstruct-2 problem in the chat template (an assumption)


@dataclass(frozen=True)
class PublishedRun:
    """One row of NeMo-RL's H100 BF16 table (on-policy GRPO)."""

    model: str
    gpus: int
    sequences: int  # G-GBS: prompts x generations per step
    mean_tokens: int  # G-Average Seq len: prompt + response
    max_tokens: int  # T-Max Sequence Length (vLLM's max_model_len)
    train_batch: int  # T-GBS: sequences per optimizer step
    engine_tp: int
    tp: int
    cp: int
    ep: int
    pp: int
    recompute: bool  # activation_checkpointing in the recipe
    tokens_per_s_per_gpu: float
    step_s: float
    release: str


PUBLISHED_RUNS: dict[str, PublishedRun] = {
    "Llama-3.1-8B-Instruct": PublishedRun("meta-llama/Llama-3.1-8B-Instruct", 16, 2048, 1019, 4096, 512, 1,
                                          1, 1, 1, 2, True, 1581.0, 92.8, "v0.5"),
    "Qwen3-32B": PublishedRun("Qwen/Qwen3-32B", 32, 2048, 3251, 4096, 512, 4, 4, 1, 1, 4, False, 571.0, 376.0, "v0.5"),
    # the base model's architecture: NeMo-RL ran the post-trained Qwen3-30B-A3B
    "Qwen3-30B-A3B": PublishedRun("Qwen/Qwen3-30B-A3B-Base", 32, 2048, 3203, 4096, 512, 2, 1, 1, 8, 1, False,
                                  1102.0, 192.0, "v0.6"),
    "Qwen3-235B-A22B": PublishedRun("Qwen/Qwen3-235B-A22B", 128, 512, 5698, 8192, 512, 16, 2, 2, 16, 8, True,
                                    58.9, 395.0, "v0.6"),
}


def grpo_step(run: PublishedRun, t: Throughput | None = None, gpus_per_node: int = 8) -> dict[str, float]:
    """Seconds of one synchronous, colocated GRPO step by phase, and tokens/s/GPU as NeMo-RL counts them."""
    t = t or Throughput.for_gpu("h100")
    spec = model_spec(run.model)
    engines = run.gpus // run.engine_tp
    em = engine_memory(spec, run.engine_tp, 80.0, NEMO_RL_ENGINE_MEMORY_UTILIZATION, run.max_tokens)
    generation, _, _ = decode_phase(spec, run.engine_tp, engines, em.max_sequences, em.kv_bytes_per_token,
                                    run.max_tokens, run.sequences, PROMPT_TOKENS, run.mean_tokens - PROMPT_TOKENS,
                                    run.max_tokens - PROMPT_TOKENS, t, gpus_per_node)
    dp = run.gpus // (run.tp * run.pp * run.cp)
    train = PolicyTrainConfig(recompute="full" if run.recompute else "off")
    flags = activation_flags(ParallelConfig(tensor_parallel=run.tp), train, run.tp, on_gpu=True,
                             transformer_engine=True)
    mem = learner_memory(spec, run.tp, run.pp, dp, run.mean_tokens // run.cp, ep=run.ep, flags=flags)
    steps = max(1, run.sequences // run.train_batch)
    tokens = run.sequences * run.mean_tokens
    work = LearnerWork(tokens=tokens, mean_row_tokens=run.mean_tokens, forwards=2,
                       recomputed_params=spec.active_parameters if run.recompute else 0.0,
                       full_recompute=run.recompute, micro_batches=run.sequences / dp / steps, steps=steps)
    learner = learner_seconds(spec, work, mem.weights, run.gpus, run.tp, run.pp, dp, gpus_per_node, t, cp=run.cp)
    if mem.all_to_all_gib:  # per micro-batch: one sequence
        learner["all_to_all"] = all_to_all_seconds(run.sequences / dp, mem.all_to_all_gib, work,
                                                   run.ep <= gpus_per_node, t)  # ETP = 1 (plan_costs)
    # colocated: the engines' weights to the host and back, the learner's optimizer state out for
    # the generation and back (as the SPICE planner's colocated iteration has them)
    moved = 2 * em.weights + 2 * mem.optimizer
    out = {"generation": generation, **{f"train_{k}": v for k, v in learner.items()},
           "refit": 2 * spec.num_parameters / run.gpus * run.engine_tp / (t.ipc_gb_s * 1e9) + 1.0,
           "sleep_wake_offload": moved * GiB / (t.host_gb_s * 1e9) + 2.0}
    out["total"] = sum(out.values())
    out["tokens_per_s_per_gpu"] = tokens / out["total"] / run.gpus
    return out


def calibration_rows(t: Throughput | None = None) -> list[tuple[str, PublishedRun, dict[str, float]]]:
    return [(name, run, grpo_step(run, t)) for name, run in PUBLISHED_RUNS.items()]
