"""What the colocated learner moves off its GPU between steps (spice_megatron/loop/colocation.py): the
optimizer's own tensors, never a view of the model's weights. Stand-ins with megatron's attribute
names (a HybridDeviceOptimizer cannot be built without CUDA). A move to float64 stands for the move
to the host, so what moved is visible on a CPU."""
from types import SimpleNamespace

import pytest
import torch

from spice_megatron.loop.colocation import optimizer_to

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


class _Fleet:
    def __init__(self, not_asleep: list[str]):
        self.calls: list[tuple] = []
        self.not_asleep = not_asleep

    def sleep(self, level):
        self.calls.append(("sleep", level))
        return {"seconds": 0.1, "freed_gib": 1.0, "requests_while_asleep": 0, "not_asleep": self.not_asleep}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return {"seconds": 0.0, "taken_gib": 0.0, "requests_while_asleep": 0, "not_awake": []}


class _Driver:
    def __init__(self, fleet: _Fleet, cluster: list[str]):
        self.fleet, self.cluster, self.killed = fleet, cluster, []

    def kill_engines(self, urls):
        self.killed += [u for u in urls if u not in self.cluster]
        return [u for u in urls if u in self.cluster]


def _colocation(monkeypatch, tmp_path, not_asleep=(), cluster=()):
    from spice_megatron.loop import colocation

    monkeypatch.setattr(colocation, "broadcast_from_driver", lambda obj, group: obj)  # one rank
    cfg = SimpleNamespace(run=SimpleNamespace(colocate=True, output_dir=str(tmp_path)),
                          rollout=SimpleNamespace(sleep_level=1))
    driver = _Driver(_Fleet(list(not_asleep)), list(cluster))
    return colocation.Colocation(cfg, learner=None, driver=driver, control=None), driver


def test_an_engine_that_did_not_sleep_never_shares_the_gpu_with_the_step(monkeypatch, tmp_path):
    """A failed /sleep once left the engine awake beside the learner's step
    (an out-of-memory step). The driver's own engine is killed (restarted before the next sync); a
    cluster's, which the driver cannot stop, ends the run with one line naming it."""
    from spice_megatron.loop.colocation import EngineNotAsleep

    colocation, driver = _colocation(monkeypatch, tmp_path, not_asleep=["http://node1:8000"])
    colocation.before_step(1)
    assert driver.killed == ["http://node1:8000"]
    colocation, driver = _colocation(monkeypatch, tmp_path, not_asleep=["http://node1:8000"],
                                     cluster=["http://node1:8000"])
    with pytest.raises(EngineNotAsleep, match="http://node1:8000 did not go to sleep"):
        colocation.before_step(1)


def test_a_sync_outside_the_turn_runs_with_the_kv_cache_asleep(monkeypatch, tmp_path):
    """The resume sync and the one after engines were restarted (they start awake) run as the
    iteration's: engines hold their weights alone, and the KV cache wakes after the sync."""
    colocation, driver = _colocation(monkeypatch, tmp_path)
    driver.fleet.calls.clear()
    colocation.before_sync()
    colocation.after_sync()
    assert driver.fleet.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
