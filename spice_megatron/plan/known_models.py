"""Architecture facts (config.json) of the recipes' base models, so that `spice plan` can plan a run on
a machine that has not downloaded them. A local model directory always takes precedence."""
from __future__ import annotations


def _cfg(arch: str, hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool, theta: float,
         **extra) -> dict:
    return {"architectures": [arch], "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 128, "intermediate_size": ffn, "vocab_size": vocab,
            "tie_word_embeddings": tied, "rope_theta": theta, "max_position_embeddings": 32768, **extra}


_LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}}
KNOWN_MODELS: dict[str, dict] = {
    "Qwen/Qwen3-4B-Base": _cfg("Qwen3ForCausalLM", 2560, 36, 32, 8, 9728, 151936, True, 1e6),
    "Qwen/Qwen3-8B-Base": _cfg("Qwen3ForCausalLM", 4096, 36, 32, 8, 12288, 151936, False, 1e6),
    "Qwen/Qwen3-14B-Base": _cfg("Qwen3ForCausalLM", 5120, 40, 40, 8, 17408, 151936, False, 1e6),
    "Qwen/Qwen3-32B": _cfg("Qwen3ForCausalLM", 5120, 64, 64, 8, 25600, 151936, False, 1e6),
    "OctoThinker/OctoThinker-3B-Hybrid-Base": _cfg("LlamaForCausalLM", 3072, 28, 24, 8, 8192, 128256, True, 5e5,
                                                   **_LLAMA3_ROPE),
    "OctoThinker/OctoThinker-8B-Hybrid-Base": _cfg("LlamaForCausalLM", 4096, 32, 32, 8, 14336, 128256, False, 5e5,
                                                   **_LLAMA3_ROPE),
    # NeMo-RL's published Llama run (plan/calibration.py)
    "meta-llama/Llama-3.1-8B-Instruct": _cfg("LlamaForCausalLM", 4096, 32, 32, 8, 14336, 128256, False, 5e5,
                                             **_LLAMA3_ROPE),
    "meta-llama/Llama-3.3-70B-Instruct": _cfg("LlamaForCausalLM", 8192, 80, 64, 8, 28672, 128256, False, 5e5,
                                              **_LLAMA3_ROPE),
    # Qwen2.5: q/k/v biases; 28 query heads over 4 KV groups (TP divides 4)
    "Qwen/Qwen2.5-7B": _cfg("Qwen2ForCausalLM", 3584, 28, 28, 4, 18944, 152064, False, 1e6,
                            max_position_embeddings=131072, use_sliding_window=False),
    # DeepSeek-V3: latent attention, 256 routed experts in 8 groups (top 8 within 4 groups) + 1 shared,
    # the first 3 layers dense; published as FP8 with 128x128 block scales (dequantized on import)
    "deepseek-ai/DeepSeek-V3-Base": _cfg(
        "DeepseekV3ForCausalLM", 7168, 61, 128, 128, 18432, 129280, False, 10000.0, max_position_embeddings=163840,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        topk_method="noaux_tc", scoring_func="sigmoid", rope_interleave=True, num_nextn_predict_layers=1,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]}),
    # GLM-4.5-Air: 128 routed experts (top 8) + 1 shared, the first layer dense, half of each head rotates
    "zai-org/GLM-4.5-Air-Base": _cfg("Glm4MoeForCausalLM", 4096, 46, 96, 8, 10944, 151552, False, 1e6,
                                max_position_embeddings=131072, attention_bias=True, use_qk_norm=False,
                                partial_rotary_factor=0.5, n_routed_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=1408, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                                num_nextn_predict_layers=1),
    # mixture-of-experts: 128 experts, 8 per token, no shared expert, every layer sparse
    "Qwen/Qwen3-30B-A3B-Base": _cfg("Qwen3MoeForCausalLM", 2048, 48, 32, 4, 6144, 151936, False, 1e6,
                                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "Qwen/Qwen3-235B-A22B": _cfg("Qwen3MoeForCausalLM", 4096, 94, 64, 4, 12288, 151936, False, 1e6,
                                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}
