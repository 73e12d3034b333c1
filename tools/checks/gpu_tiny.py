"""The tiny Qwen3 checkpoints and learners tools/checks/gpu_check.py and its colocation checks build."""
from __future__ import annotations

import json
import os

import torch

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512, hidden_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
            torch_dtype="float32")


# the same with 8 experts of 64, top-2 (Qwen3-MoE): grouped GEMMs and their parameter names with TE
TINY_MOE = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def make_tiny_qwen3(out: str, seed: int = 7, config: dict = TINY) -> str:
    from safetensors.torch import save_file

    from spice_megatron.bridge.mapping import expected_hf_shapes
    from spice_megatron.families import model_spec_from_hf

    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_hf_shapes(model_spec_from_hf(config)).items():
        if name.endswith("mlp.gate.weight"):  # a router far from uniform: no near-ties between experts
            tensors[name] = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            tensors[name] = 0.05 * torch.randn(shape, generator=g)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def batch(n: int = 6, seed: int = 3):
    from spice_megatron.policy.batching import TrainSequence

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        ids = torch.randint(0, TINY["vocab_size"], (5 + 2 * i,), generator=g).tolist()
        seqs.append(TrainSequence(ids[:3], ids[3:], advantage=(-1.0) ** i * 0.5))
    return seqs


def learner(model_dir: str, dtype: str, lr: float, routing_replay: str = "off", **train):
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    # routing replay needs an engine's routing: off, unless a check brings routing of its own
    return learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=lr, adam_eps=1e-5, weight_decay=0.0),
                           PolicyTrainConfig(**{**dict(max_gen_len=16, micro_batch_tokens=256, dtype=dtype,
                                                       routing_replay=routing_replay), **train}))
