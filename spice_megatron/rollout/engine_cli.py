"""The engine's command-line options, one list for the service that leads an engine
(`python -m spice_megatron.rollout.serve`) and for its followers on the other nodes of a multi-node
engine (`python -m spice_megatron.rollout.follower`): every node must build the engine the same way."""
from __future__ import annotations

import argparse
from typing import Any

from spice_megatron.rollout.engine import NodeSpan, engine_kwargs


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
