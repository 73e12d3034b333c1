"""Process groups for the learner from the torchrun / srun environment."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from spice_megatron.config import ConfigError, ParallelConfig
from spice_megatron.policy import cpu_compat

log = logging.getLogger("spice.parallel")


@dataclass(frozen=True)
class Layout:
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0  # data-parallel rank among the replicas of this rank's experts
    cp: int = 1
    cp_rank: int = 0
    vpp: int = 1  # virtual pipeline stages: model chunks per rank

    @property
    def first_replica(self) -> bool:
        """Data-parallel rank 0 and context-parallel rank 0: the rank whose dense weights (and TP
        shards) stand for every copy, in exports, syncs and checkpoints' one-of-each objects."""
        return self.dp_rank == 0 and self.cp_rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


WORLD_SECRET_ENV = "SPICE_WORLD_SECRET"


def _authenticate_world(rank: int, world: int, backend: str) -> None:
    """Before any rank unpickles a peer's object (the driver's broadcasts, the batch's scatter):
    every rank proves it holds the job's secret (HMAC over its rank, all-gathered as bytes, no
    pickle). A process that took a rank's place through the rendezvous store fails it and the world
    stops with one line on every rank (docs/cluster.md, "The learner's rendezvous"). The secret:
    $SPICE_WORLD_SECRET (set by `spice train`'s relaunch) or the job's $SPICE_ROLLOUT_TOKEN (fresh per
    attempt in the Slurm and NeMo-Run scripts); without either the members are not checked."""
    import hashlib
    import hmac

    secret = os.environ.get(WORLD_SECRET_ENV) or os.environ.get("SPICE_ROLLOUT_TOKEN", "")
    if world == 1 or not secret:
        return

    def proof(r: int) -> torch.Tensor:
        digest = hmac.new(secret.encode(), f"spice-learner-member\n{r}\n{world}".encode(), hashlib.sha256).digest()
        return torch.frombuffer(bytearray(digest), dtype=torch.uint8)

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    proofs = [torch.empty(32, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(proofs, proof(rank).to(device))
    bad = [r for r in range(world) if not torch.equal(proofs[r].cpu(), proof(r))]
    if bad:
        raise RuntimeError(f"learner rank(s) {bad} could not prove they hold this job's secret (a process in a "
                           "rank's place?): stopping before any object is exchanged")


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def init_distributed(cfg: ParallelConfig, seed: int = 1234, timeout_minutes: int = 30,
                     expandable_segments: bool = True) -> Layout:
    """torch.distributed + megatron parallel state. Reads RANK/WORLD_SIZE/LOCAL_RANK (torchrun) or
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID (srun); a bare process is a world of one.
    `expandable_segments` False where CUDA IPC hands the learner's memory to another process (the
    colocated ipc weight sync): an expandable segment is a VMM allocation, which the engine can only
    open through pidfd_getfd (ptrace rights, refused in unprivileged containers and under Yama
    ptrace_scope=1; ~9x slower per vLLM where allowed)."""
    from megatron.core import parallel_state as ps

    cfg.validate()
    cpu_compat.apply()
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    if world % (cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel):
        raise ConfigError(f"parallel: world size {world} is not a multiple of tensor_parallel x pipeline_parallel "
                          f"x context_parallel = {cfg.tensor_parallel} x {cfg.pipeline_parallel} x "
                          f"{cfg.context_parallel}")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # RL micro-batches change length every step and fragment the caching allocator; its
        # expandable segments grow in place instead (read once, at CUDA's first allocation; a
        # setting of the user's is kept). tools/checks/gpu_check.py allocator_fragmentation measures it.
        if expandable_segments:
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        elif "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            log.warning("PYTORCH_CUDA_ALLOC_CONF=%s: the engines open the ipc weight sync's buffers through "
                        "pidfd_getfd, which needs ptrace rights over this process (docs/cluster.md)",
                        os.environ["PYTORCH_CUDA_ALLOC_CONF"])
        # modulo: a launcher that starts one task per node with CUDA_VISIBLE_DEVICES per task
        # leaves each task fewer devices than its local rank suggests
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a bare process (a world of one): any free port, so runs can coexist
            from spice_megatron.torchrun import free_port

            os.environ["MASTER_PORT"] = str(free_port() if world == 1 else 29500)
        timeout = timedelta(minutes=timeout_minutes)
        store = None
        if world > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # srun tasks, no torchrun agent
            from spice_megatron.torchrun import listen_on

            # rank 0 serves the world's store on MASTER_ADDR's interface only (torch's would take every one)
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            fd = listen_on(addr, port).detach() if rank == 0 else None
            store = dist.TCPStore(addr, port, world, rank == 0, timeout, master_listen_fd=fd)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=store)
        _authenticate_world(rank, world, backend)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    stage = world // cfg.pipeline_parallel
    if stage % (cfg.expert_parallel * cfg.expert_tensor_parallel):
        raise ConfigError(f"parallel.expert_parallel: expert_parallel x expert_tensor_parallel = {cfg.expert_parallel} "
                          f"x {cfg.expert_tensor_parallel} must divide the {stage} ranks of a pipeline stage")
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_parallel,
                                 pipeline_model_parallel_size=cfg.pipeline_parallel,
                                 context_parallel_size=cfg.context_parallel,
                                 virtual_pipeline_model_parallel_size=cfg.virtual_pipeline if cfg.virtual_pipeline > 1
                                 else None,
                                 expert_model_parallel_size=cfg.expert_parallel,
                                 expert_tensor_parallel_size=cfg.expert_tensor_parallel)
    cpu_compat.model_parallel_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    from megatron.core import parallel_state as ps

    return Layout(rank=dist.get_rank(), world_size=dist.get_world_size(),
                  tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                  dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                  pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
                  ep=ps.get_expert_model_parallel_world_size(), etp=ps.get_expert_tensor_parallel_world_size(),
                  ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank(),
                  edp_rank=ps.get_expert_data_parallel_rank(), cp=ps.get_context_parallel_world_size(),
                  cp_rank=ps.get_context_parallel_rank(),
                  vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1)


def layout_matches(parallel: ParallelConfig) -> bool:
    """Whether megatron's parallel state is initialized with the layout `parallel` asks for."""
    from megatron.core import parallel_state as ps

    return (ps.model_parallel_is_initialized()
            and ps.get_tensor_model_parallel_world_size() == parallel.tensor_parallel
            and ps.get_pipeline_model_parallel_world_size() == parallel.pipeline_parallel
            and ps.get_context_parallel_world_size() == parallel.context_parallel
            and (ps.get_virtual_pipeline_model_parallel_world_size() or 1) == parallel.virtual_pipeline
            and ps.get_expert_model_parallel_world_size() == parallel.expert_parallel
            and ps.get_expert_tensor_parallel_world_size() == parallel.expert_tensor_parallel)


def control_group(timeout_s: float):
    """A gloo group over all learner ranks for the driver's messages (batches, stop decisions,
    sync outcomes). While rank 0 alone runs rollouts, evaluation or start-up, the other ranks wait
    here; on the NCCL default group that wait would trip NCCL's watchdog (30 minutes), and a paper
    challenger phase (up to 1,024 attempts per document) can take longer. The wait is bounded by
    `timeout_s` (run.driver_timeout) instead."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def broadcast_from_driver(obj, group):
    """Rank 0's object on every rank, over the control group."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def any_rank(flag: bool, group) -> bool:
    """True on every rank if it is true on one (over the control group: a CPU tensor, gloo)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
