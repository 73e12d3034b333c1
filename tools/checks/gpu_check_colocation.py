"""gpu_check's colocation checks: the colocated learner's
optimizer offload, the CUDA IPC leg under the learner's allocator setting, a long-prefix
shared-prefix row, and sleep / wake / IPC transfer with a vLLM engine. Each returns (ok | None for
skipped, figures); tools/checks/gpu_check.py prints them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from gpu_tiny import TINY, batch, learner, make_tiny_qwen3

IPC_LEG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipc_leg.py")


def _buffers_hold(ddp, tensors) -> bool:
    """Every tensor's memory lies inside one of DDP's param buffers (a view, not a copy)."""
    spans = []
    for buf in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
        data = buf.param_data
        spans.append((data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()))
    return all(any(lo <= t.data_ptr() < hi for lo, hi in spans) for t in tensors)


def check_optimizer_offload_round_trip(model_dir: str) -> tuple[bool | None, str]:
    """optim.cpu_offload_fraction (megatron's HybridDeviceOptimizer over the
    precision-aware optimizer's bf16 views) through the colocated offload and reload, twice: every
    step moves the model's weights and the views stay inside DDP's buffer."""
    if not torch.cuda.is_available():
        return None, "needs a GPU (HybridDeviceOptimizer)"
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.loop.colocation import offload_learner, reload_learner
    from spice_megatron.policy import learner as learner_module

    # without TE or apex the learner refuses megatron's torch distributed optimizer for its broken
    # checkpoint restore, which this check never runs
    learner_module.ALLOW_TORCH_DISTRIBUTED_OPTIMIZER = True
    try:
        lr = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-3, adam_eps=1e-5, weight_decay=0.0,
                                                                      use_distributed_optimizer=True,
                                                                      cpu_offload_fraction=0.5),
                             PolicyTrainConfig(max_gen_len=16, micro_batch_tokens=256, dtype="bf16"))
        moved, views = [], []
        offload_learner(lr)  # as the trainer does before the first rollouts
        for _ in range(3):
            reload_learner(lr)
            before = gathered_hf_state_dict(lr)
            lr.train_on_batch(batch())
            after = gathered_hf_state_dict(lr)
            moved.append(max((after[k].float() - before[k].float()).abs().max().item() for k in after))
            groups = [p for opt in getattr(lr.optimizer, "chained_optimizers", [lr.optimizer])
                      for g in opt.optimizer.param_groups for p in g["params"]]
            views.append(_buffers_hold(lr.ddp, groups))
            offload_learner(lr)
    finally:
        learner_module.ALLOW_TORCH_DISTRIBUTED_OPTIMIZER = False
    free = torch.cuda.mem_get_info()[0] / 2**30
    ok = all(m > 0 for m in moved) and all(views)
    return ok, (f"weights moved per step {', '.join(f'{m:.1e}' for m in moved)} (broken: 0 after the first "
                f"offload), param_groups inside DDP's buffer {views}, free after offload {free:.1f} GiB")


def _as_nobody():
    os.setgid(65534)
    os.setuid(65534)


def check_ipc_leg(work: str) -> tuple[bool | None, str]:
    """A learner process exports a staging buffer (torch's reduce_tensor, as
    vLLM's packed IPC producer does) and a sibling process, as an engine is, opens it
    (rebuild_cuda_tensor), each in a fresh process so the allocator reads its setting: the
    learner's setting for the ipc sync (expandable segments off) must work, also as a non-root user;
    expandable segments on is reported beside it (pidfd_getfd needs ptrace rights)."""
    if not torch.cuda.is_available():
        return None, "needs a GPU (CUDA IPC)"
    try:
        scope = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        scope = "absent"
    # a folder any user can read: the leg needs only torch, not the repository
    leg_dir = tempfile.mkdtemp(dir=work)
    os.chmod(work, 0o755)
    os.chmod(leg_dir, 0o777)
    leg = shutil.copy(IPC_LEG, leg_dir)
    users = [("root", None), ("nobody", _as_nobody)] if os.geteuid() == 0 else [(f"uid {os.geteuid()}", None)]
    results, ok = [], True
    for user, demote in users:
        for conf in ("", "expandable_segments:True"):
            out = os.path.join(leg_dir, f"leg_{user.replace(' ', '_')}_{bool(conf)}.json")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env.update(PYTORCH_CUDA_ALLOC_CONF=conf, HOME=leg_dir)
            proc = subprocess.run([sys.executable, leg, out], env=env, preexec_fn=demote, cwd=leg_dir,
                                  capture_output=True, text=True, timeout=180)
            try:
                r = json.load(open(out))
            except (OSError, ValueError):
                r = {"ok": False, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
            label = f"{user} {'expandable' if conf else 'default'}"
            if r.get("ok"):
                results.append(f"{label}: ok, open {r['open_ms']:.0f} ms (segment expandable {r['expandable']})")
            else:
                results.append(f"{label}: FAILED {r.get('error', '')}")
                ok = ok and bool(conf)  # the learner's ipc setting (default allocator) must work
    return ok, f"ptrace_scope {scope}; " + "; ".join(results)


def check_long_prefix_row(work: str) -> tuple[bool | None, str]:
    """One challenger-like row (a 6,000-token prefix, 3 completions of 600) at
    Qwen3-4B widths, packed to a multiple of 1 and of 128 (the pads under sequence parallelism):
    the step's time at pad_to=128 against pad_to=1, and its peak memory above the resting state
    against the planner's activations + logits for the row; on a GPU the flex kernel beside sdpa.
    On CPU (the smoke run) the verdict is the log-probs' equality at both paddings, not a time."""
    from spice_megatron.plan.memory import learner_memory
    from spice_megatron.policy.batching import TrainSequence

    on_gpu = torch.cuda.is_available()
    config = dict(TINY, hidden_size=2560, intermediate_size=9728, num_hidden_layers=2, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128) if on_gpu else TINY
    model_dir = make_tiny_qwen3(os.path.join(work, "long_prefix_model"), config=config)
    prefix_len, completion_len = (6000, 600) if on_gpu else (600, 60)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, TINY["vocab_size"], (prefix_len,), generator=g).tolist()
    seqs = [TrainSequence(prompt, torch.randint(0, TINY["vocab_size"], (completion_len - 8 * i,), generator=g).tolist(),
                          advantage=(-1.0) ** i * 0.5) for i in range(3)]
    tokens = prefix_len + sum(len(s.completion_ids) for s in seqs)
    seconds, peak, logprobs = {}, {}, {}
    # the sdpa kernel at both paddings; on a GPU the flex kernel too (train.shared_prefix_kernel,
    # chosen by this measurement)
    for kernel, pad_to in [("sdpa", 1), ("sdpa", 128)] + ([("flex", 128)] if on_gpu else []):
        lr = learner(model_dir, "bf16", 1e-6, shared_prefix="on", max_gen_len=1024, micro_batch_tokens=8192,
                     shared_prefix_kernel=kernel)
        lr.seq_multiple = pad_to
        logprobs[kernel, pad_to] = lr.compute_logprobs(seqs)
        lr.train_on_batch(seqs)  # warm-up (the optimizer's state, flex's compilation)
        times = []
        for _ in range(3):
            if on_gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                resting = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            lr.train_on_batch(seqs)
            if on_gpu:
                torch.cuda.synchronize()
                peak[kernel, pad_to] = (torch.cuda.max_memory_allocated() - resting) / 2**30
            times.append(time.perf_counter() - t0)
        seconds[kernel, pad_to] = sorted(times)[1]
    ratio = seconds["sdpa", 128] / seconds["sdpa", 1]
    figures = (f"{tokens:,}-token row: step {seconds['sdpa', 1] * 1e3:.0f} ms at pad_to=1, "
               f"{seconds['sdpa', 128] * 1e3:.0f} ms at pad_to=128 ({ratio:.2f}x, target <= 1.25)")
    def gap(a, b) -> float:
        return max(abs(u - w) for x, y in zip(logprobs[a], logprobs[b]) for u, w in zip(x, y))

    padded = gap(("sdpa", 128), ("sdpa", 1))  # the pads change nothing a completion sees
    figures += f"; |dlogp| pad_to=128 vs 1 max {padded:.1e}"
    if not on_gpu:  # the CI smoke run: a verdict on exactness alone, never on a CPU's timing
        return padded < 1e-6, figures
    mem = learner_memory(lr.spec, 1, 1, 1, tokens, flags=lr.activation_flags)  # the same flags for every kernel
    planned = mem.activations + mem.logits
    over = peak["sdpa", 128] / planned
    flex_gap = gap(("flex", 128), ("sdpa", 128))
    figures += (f"; peak above resting {peak['sdpa', 128]:.2f} GiB vs planner's activations + logits "
                f"{planned:.2f} GiB ({over:.2f}x, target <= 1.3); flex kernel: step "
                f"{seconds['flex', 128] * 1e3:.0f} ms, peak {peak['flex', 128]:.2f} GiB, |dlogp| vs sdpa max "
                f"{flex_gap:.3f} "
                f"(faster: {'flex' if seconds['flex', 128] < seconds['sdpa', 128] else 'sdpa'})")
    return ratio <= 1.25 and over <= 1.3 and padded < 1e-6 and flex_gap < 0.05, figures


def check_colocation(work: str) -> tuple[bool | None, str]:
    """run.colocate on one GPU: a vLLM engine in sleep mode beside a bf16 learner. The device memory
    freed by sleep level 1 and 2 and taken back by each wake; then vLLM's CUDA IPC weight transfer
    (engine_weights._ipc_transfer: the learner's whole-model source, packed) into the engine woken
    weights-first after a level-2 sleep, its KV cache woken after; vLLM's weight checksums and greedy
    log-probs equal a fresh engine's on the learner's exported weights; seconds of sleep, wake and
    the transfer per GB; the device memory the sync phase holds after the send, before and after
    the learner empties its cache, beside the planner's sync-phase buffers. Needs vLLM (not in the
    lent machine's environment unless installed)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None, "vLLM is not installed in this environment"
    from spice_megatron.bridge.convert import save_hf_checkpoint
    from spice_megatron.bridge.trainer_transfer import MegatronStageSource
    from spice_megatron.data.offline_assets import make_tiny_engine_model
    from spice_megatron.loop.engine_weights import _ipc_transfer
    from spice_megatron.rollout.fleet import RolloutFleet
    from spice_megatron.rollout.local import start_engines
    from spice_megatron.wire.types import SamplingSpec

    model_dir = make_tiny_engine_model(os.path.join(work, "tiny_engine_qwen3"), "qwen3", seed=4)  # with a tokenizer
    lrn = learner(model_dir, "bf16", 1e-3)
    lrn.train_on_batch(batch())  # weights that differ from the engine's
    exported = os.path.join(work, "colocated_learner_hf")
    save_hf_checkpoint(lrn, exported, model_dir)
    token = "gpu-check"
    args = ["--gpu-memory-utilization", "0.25", "--max-model-len", "256", "--enforce-eager",
            "--weight-transfer", "ipc", "--enable-sleep-mode"]
    os.environ["SPICE_ROLLOUT_TOKEN"] = token
    (engine,) = start_engines(model_dir, token, os.path.join(work, "logs"), args, [{}], timeout=400)
    fresh = None
    try:
        fleet = RolloutFleet([engine.url], token)
        fleet.health()
        free = lambda: torch.cuda.mem_get_info(0)[0] / 2**30  # noqa: E731 - device-wide, as nvidia-smi
        figures, t = {}, time.perf_counter
        for level in (1, 2):
            f0, t0 = free(), t()
            fleet.sleep(level)
            figures[f"sleep{level}_s"], figures[f"freed{level}_gib"] = t() - t0, free() - f0
            f0, t0 = free(), t()
            fleet.wake_up(["weights"] if level == 2 else None)
            figures[f"wake{level}_s"], figures[f"taken{level}_gib"] = t() - t0, f0 - free()
            if level == 2:  # the weights were discarded: the transfer refills them before the KV cache wakes
                client = fleet.sync_client()
                client.version = "1"
                source = MegatronStageSource(lrn)
                control = torch.distributed.new_group(backend="gloo")  # the learner's control group
                transfer = _ipc_transfer(client, source, 64 * 2**20, control)
                f0, t0 = free(), t()
                transfer.send_weights()
                figures["ipc_s_per_gb"] = (t() - t0) / (source.nbytes / 1e9)
                # what the sync phase still holds after the send (learner's staging buffer, the
                # engine's chunk clone) against the planner's 2 x staging + largest tensor
                staging = max(64 * 2**20, transfer.source.largest_tensor_bytes)
                figures["sync_held_gib"] = f0 - free()
                figures["sync_planned_gib"] = (2 * staging + transfer.source.largest_tensor_bytes) / 2**30
                torch.cuda.empty_cache()  # as Colocation.after_sync
                figures["after_sync_empty_cache_gib"] = f0 - free()
                fleet.wake_up(["kv_cache"])
        (fresh,) = start_engines(exported, token, os.path.join(work, "logs"),
                                 [a for a in args if a != "--enable-sleep-mode"], [{}], timeout=400)
        fresh_fleet = RolloutFleet([fresh.url], token)
        same_sums = fleet.weight_checksums() == fresh_fleet.weight_checksums()
        spec = SamplingSpec(n=1, temperature=0.0, max_tokens=8, logprobs=True)
        prompts = [x.prompt_ids for x in batch()]
        a = [c[0].logprobs for c in fleet.generate(prompts, spec)]
        b = [c[0].logprobs for c in fresh_fleet.generate(prompts, spec)]
        gap = max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))
    finally:
        engine.stop()
        if fresh is not None:
            fresh.stop()
    shown = ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
    ok = (same_sums and gap < 1e-3 and figures["freed1_gib"] > 0 and figures["freed2_gib"] > 0
          and figures["sync_held_gib"] <= figures["sync_planned_gib"])
    return ok, f"{shown}; checksums equal a fresh engine's {same_sums}; greedy |dlogp| max {gap:.2e}"
