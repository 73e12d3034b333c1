"""gpu_check's engine checks. The FP8 guard: a block-FP8 model directory is refused for the engines and
`spice convert bf16` writes the copy they serve. An engine across nodes, what one GPU can run of it: the
leader's and a follower's vLLM configs built on this machine's real GPU, the way rollout/serve.py
(`vllm.LLM`, UsageContext.LLM_CLASS) and rollout/follower.py (OPENAI_API_SERVER, headless) build
them, compared setting by setting. Nothing starts. The suite runs the same comparison under a
simulated H100 and H200 (tests/test_gpu_defaults.py); here vLLM reads the real device. What one GPU
cannot show is listed by `NEEDS_MORE`, printed with every run."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    from spice_megatron.data.offline_assets import make_tiny_engine_model
    from spice_megatron.rollout.engine_args import NodeSpan, engine_kwargs
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


def check_fp8_engine_guard(work: str) -> tuple[bool | None, str]:
    """A tiny Qwen3 saved with block-FP8 weights (the published Qwen3-*-FP8 form): the engine guard
    refuses it, `spice convert bf16` writes the copy the engines serve, and that copy's weights are
    what the learner imports (dequantized on this device)."""
    import torch
    from gpu_tiny import TINY, make_tiny_qwen3
    from safetensors.torch import load_file, save_file

    from spice_megatron.bridge.dequantize import QuantizedEngineModel, check_engine_model
    from spice_megatron.bridge.hf_io import HFCheckpointReader

    src = make_tiny_qwen3(os.path.join(work, "fp8_src"))
    fp8, bf16 = os.path.join(work, "fp8"), os.path.join(work, "fp8_bf16")
    os.makedirs(fp8)
    block, tensors = 32, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        if w.dim() == 2 and ".layers." in name:
            blocks = w.view(w.shape[0] // block, block, w.shape[1] // block, block)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            tensors[name] = (blocks / scale[:, None, :, None]).view_as(w).to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = scale.float()
        else:
            tensors[name] = w
    save_file(tensors, os.path.join(fp8, "model.safetensors"))
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump({**TINY, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                   "weight_block_size": [block, block]}}, f)
    try:
        check_engine_model(fp8)
        return False, "the guard let an FP8 engine directory through"
    except QuantizedEngineModel:
        pass
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "convert", "bf16", "--model", fp8, "--output",
                        bf16],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    if r.returncode != 0:
        return False, f"spice convert bf16 failed: {r.stderr[-500:]}"
    check_engine_model(bf16)
    reader, copy = HFCheckpointReader(fp8), load_file(os.path.join(bf16, "model.safetensors"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    wrong = [n for n in copy if not torch.equal(copy[n].to(dev), reader.read(n, None, None, None).to(dev))]
    return not wrong, (f"FP8 directory refused for the engines; bf16 copy of {len(copy)} tensors, "
                       f"{len(wrong)} differing from the learner's import")
