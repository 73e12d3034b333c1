"""gpu_check's check of an engine across nodes that one GPU can run (GPU review 4, finding 1): the
leader's and a follower's vLLM configs built on this machine's real GPU, the way rollout/serve.py
(`vllm.LLM`, UsageContext.LLM_CLASS) and rollout/follower.py (OPENAI_API_SERVER, headless) build
them, compared setting by setting. Nothing starts. The suite runs the same comparison under a
simulated H100 and H200 (tests/test_gpu_defaults.py); here vLLM reads the real device. What one GPU
cannot show is listed by `NEEDS_MORE`, printed with every run."""
from __future__ import annotations

import os
import socket

NEEDS_MORE = ("needs 4 GPUs: receive_order_nccl over NCCL (runs on gloo with fewer); needs 2 GPUs and Transformer "
              "Engine: te_context_parallel; needs an 8-GPU node or two nodes: an engine across nodes generating a "
              "batch of more than 8,192 prompt tokens, and a follower's kill -9 during it (the leader's GPUs free "
              "within 30 s, the restarted engine serving): docs/cluster.md, 'Checks that need more GPUs'")


def check_engine_step_agrees(work: str) -> tuple[bool | None, str]:
    try:
        from vllm import EngineArgs
        from vllm.usage.usage_lib import UsageContext
    except ImportError:
        return None, ("needs vLLM (the rollout image): run `python tools/checks/gpu_check.py --only "
                      "engine_step_leader_vs_follower` there")
    from spice_megatron.offline_assets import make_tiny_engine_model
    from spice_megatron.rollout.engine import NodeSpan, engine_kwargs
    from spice_megatron.rollout.step_settings import agreed_settings

    model = make_tiny_engine_model(os.path.join(work, "engine_step_qwen3"), "qwen3")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    built = {}
    for rank, usage in ((0, UsageContext.LLM_CLASS), (1, UsageContext.OPENAI_API_SERVER)):
        kwargs, _, _ = engine_kwargs(model, max_model_len=2048, tensor_parallel_size=2,
                                     span=NodeSpan(2, rank, "127.0.0.1", port))
        built[rank] = agreed_settings(EngineArgs(**kwargs).create_engine_config(usage_context=usage,
                                                                                headless=rank > 0))
    differ = {k.split(".", 1)[1]: (built[0][k], built[1][k]) for k in built[0] if built[0][k] != built[1][k]}
    lead = built[0]
    return not differ, (f"leader and follower: {lead['scheduler_config.max_num_batched_tokens']} tokens, "
                        f"{lead['scheduler_config.max_num_seqs']} sequences a step, chunked prefill "
                        f"{lead['scheduler_config.enable_chunked_prefill']}, KV block {lead['cache_config.block_size']}"
                        + (f"; DIFFER (leader, follower): {differ}" if differ else "; every setting the same"))
