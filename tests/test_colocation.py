"""What the colocated learner moves off its GPU between steps (spice_megatron/colocation.py): the
optimizer's own tensors, never a view of the model's weights. Stand-ins with megatron's attribute
names (a HybridDeviceOptimizer cannot be built without CUDA). A move to float64 stands for the move
to the host, so what moved is visible on a CPU."""
from types import SimpleNamespace

import torch

from spice_megatron.colocation import optimizer_to

MOVED = torch.float64


def _stepped(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _megatron(inner, precision_aware: bool, bf16: bool = True):
    return SimpleNamespace(optimizer=inner, config=SimpleNamespace(use_precision_aware_optimizer=precision_aware,
                                                                   bf16=bf16))


def _in(buffer: torch.Tensor, view: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_the_hybrid_device_optimizer_moves_its_gpu_share_and_keeps_the_weight_views():
    # the precision-aware distributed optimizer: param_groups are bf16 views into DDP's buffer; HDO
    # gives the GPU share fp32 clones (its own Adam) and the CPU share a CPU Adam
    buffer = torch.arange(8, dtype=torch.bfloat16)
    views = [buffer[:4], buffer[4:]]
    gpu_copy, cpu_copy = views[0].detach().clone().float(), views[1].detach().clone().float()
    gpu_opt, cpu_opt = _stepped([gpu_copy]), _stepped([cpu_copy])
    gpu_opt.state[gpu_copy]["master_param"] = gpu_copy  # as HDO's _sync_sub_optimizers_state_to_hdo adds
    hdo = SimpleNamespace(param_groups=[{"params": views}], gpu_optimizer=gpu_opt,
                          fp32_param_to_orig_param={gpu_copy: views[0]},
                          state={views[0]: gpu_opt.state[gpu_copy], views[1]: cpu_opt.state[cpu_copy]})
    optimizer_to(_megatron(hdo, precision_aware=True), MOVED)
    assert all(_in(buffer, v) and v.dtype == buffer.dtype for v in views)  # the model still trains itself
    assert gpu_copy.dtype == MOVED and gpu_opt.state[gpu_copy]["exp_avg"].dtype == MOVED
    assert hdo.state[views[0]]["master_param"] is gpu_copy  # still the param the GPU Adam steps
    assert cpu_copy.dtype == torch.float32 and cpu_opt.state[cpu_copy]["exp_avg"].dtype == torch.float32


def test_weights_in_param_groups_stay_and_fp32_main_weights_move():
    buffer = torch.zeros(6)
    views = [buffer[:3], buffer[3:]]
    for precision_aware, bf16 in ((False, False), (True, True)):  # fp32; bf16 precision-aware (bf16 views)
        opt = _stepped(views)
        optimizer_to(_megatron(opt, precision_aware, bf16), MOVED)
        assert all(_in(buffer, v) and v.dtype == buffer.dtype for v in views)
        assert all(s["exp_avg"].dtype == MOVED for s in opt.state.values())
    main = [torch.zeros(3), torch.zeros(3)]  # bf16 mixed precision: param_groups are fp32 clones
    opt = _stepped(main)
    optimizer_to(SimpleNamespace(chained_optimizers=[_megatron(opt, precision_aware=False)]), MOVED)
    assert all(p.dtype == MOVED for p in main)
    assert all(s["exp_avg"].dtype == MOVED for s in opt.state.values())
