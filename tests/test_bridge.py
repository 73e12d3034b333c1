"""HF <-> Megatron conversion and weight streaming (multi-process, gloo)."""
import json
import os
import resource

import pytest
import torch
from dist_utils import free_port, run_ranks
from safetensors.torch import load_file, save_file

from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config

MODELS = {"qwen3_untied": ("qwen3", False), "qwen3_tied": ("qwen3", True), "llama_untied": ("llama", False),
          "qwen2_tied": ("qwen2", True),  # Qwen2.5 up to 3B ties its embeddings; qwen2 also has q/k/v biases
          "deepseek_v3": ("deepseek_v3", False),  # latent attention; layer 0 dense, layer 1 experts + shared
          "glm4_moe": ("glm4_moe", False)}  # biases, q/k norms, partial rotary; DeepSeek-V3's routing


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_hf_model(str(root / name), tiny_hf_config(fam, tied), seed=2)
            for name, (fam, tied) in MODELS.items()}


def hf_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(model_dir, "model.safetensors"))
    out = {}
    for f in set(json.load(open(index))["weight_map"].values()):
        out.update(load_file(os.path.join(model_dir, f)))
    return out


def _roundtrip_rank(models, root, tp, pp):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from spice_megatron.bridge.convert import convert_from_hf, convert_to_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.batching import TrainSequence, collate
    from spice_megatron.policy.checkpoint import load_checkpoint
    from spice_megatron.policy.checkpoint_files import latest_checkpoint
    from spice_megatron.policy.learner import Learner

    logits = {}
    for name, d in models.items():
        ckpt, out = os.path.join(root, name, "ckpt"), os.path.join(root, name, f"hf_tp{tp}_pp{pp}")
        convert_from_hf(d, ckpt, tp, pp)
        convert_to_hf(ckpt, out, tp, pp)
        # the megatron model's logits, for comparison with transformers on the exported directory
        learner = Learner(model_spec_from_hf(d), ParallelConfig(tp, pp), OptimConfig(), PolicyTrainConfig())
        load_checkpoint(learner, latest_checkpoint(ckpt), model_only=True)
        tokens = torch.arange(2 * 9).view(2, 9) * 7 % 256
        seqs = [TrainSequence(t[:3].tolist(), t[3:].tolist()) for t in tokens]
        with torch.no_grad():
            outs = learner._run([collate(seqs, [0, 1], pad_to=learner.seq_multiple)],
                                lambda mb, lg: (torch.zeros(()), {"l": gather_from_tensor_model_parallel_region(lg)}),
                                forward_only=True)
        if outs:
            logits[name] = outs[0]["l"][:, :tokens.shape[1]]
    return logits


@pytest.mark.multiprocess
@pytest.mark.slow
def test_roundtrip_bit_exact_through_tp2_x_pp2(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    root = str(tmp_path / "rt")
    results = run_ranks(_roundtrip_rank, 4, tiny_models, root, 2, 2, tmp_path=tmp_path)
    megatron_logits = {k: v for r in results for k, v in r.items()}
    for name, d in tiny_models.items():
        original, exported = hf_weights(d), hf_weights(os.path.join(root, name, "hf_tp2_pp2"))
        assert exported.keys() == original.keys(), name  # tied: no lm_head added or lost
        assert all(torch.equal(exported[k], original[k]) for k in original), name
        out = os.path.join(root, name, "hf_tp2_pp2")
        assert json.load(open(os.path.join(out, "config.json")))["architectures"] == \
            json.load(open(os.path.join(d, "config.json")))["architectures"]
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        tokens = torch.arange(2 * 9).view(2, 9) * 7 % 256
        with torch.no_grad():
            assert (model(tokens).logits - megatron_logits[name]).abs().max().item() < 1e-4, name


def _reshard_export_rank(ckpt, out):
    from spice_megatron.bridge.convert import convert_to_hf

    convert_to_hf(ckpt, out, tp=1, pp=1)


@pytest.mark.multiprocess
def test_export_reshards_a_tp2_checkpoint_to_one_rank(tiny_models, tmp_path):
    d = tiny_models["llama_untied"]
    run_ranks(_convert_rank, 2, d, str(tmp_path / "ckpt"), 2, 1, tmp_path=tmp_path)
    run_ranks(_reshard_export_rank, 1, str(tmp_path / "ckpt"), str(tmp_path / "out"), tmp_path=tmp_path)
    original, exported = hf_weights(d), hf_weights(str(tmp_path / "out"))
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.multiprocess
def test_the_conversion_tools_take_uneven_pipeline_stages(tmp_path):
    """HF -> a checkpoint in stages of 1 and 2 layers -> HF from stages of 2 and 1, through the tools'
    --first-stage-layers / --last-stage-layers (how the 94-layer Qwen3-235B recipe lays its stages
    out): bit-exact."""
    import subprocess
    import sys

    tools = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
    d = make_tiny_hf_model(str(tmp_path / "hf"), tiny_hf_config("qwen3", num_layers=3), seed=3)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    for args in (["convert_from_hf.py", "--hf", d, "--out", ckpt, "--pp", "2", "--first-stage-layers", "1"],
                 ["convert_to_hf.py", "--ckpt", ckpt, "--out", out, "--pp", "2", "--last-stage-layers", "1"]):
        r = subprocess.run([sys.executable, os.path.join(tools, args[0]), *args[1:]], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    original, exported = hf_weights(d), hf_weights(out)
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)


def _convert_rank(hf_dir, out, tp, pp):
    from spice_megatron.bridge.convert import convert_from_hf

    convert_from_hf(hf_dir, out, tp, pp)


def _expect_errors(cases, root):
    from spice_megatron.bridge.convert import convert_from_hf

    errors = {}
    for case, hf_dir in cases.items():
        try:
            convert_from_hf(hf_dir, os.path.join(root, case), 1, 1)
            errors[case] = "no error"
        except Exception as e:
            errors[case] = f"{type(e).__name__}: {e}"
    return errors


@pytest.mark.multiprocess
def test_bad_checkpoints_name_the_tensor(tiny_models, tmp_path):
    import shutil

    src = tiny_models["qwen3_untied"]
    weights = load_file(os.path.join(src, "model.safetensors"))
    cases = {}
    for case, edit in {
        "missing": lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"),
        "shape": lambda w: w.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(64, 96)),
        "larger": lambda w: w.__setitem__("model.embed_tokens.weight", torch.zeros(300, 64)),
        "dtype": lambda w: w.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int64)),
    }.items():
        d = tmp_path / case
        shutil.copytree(src, d)
        w = dict(weights)
        edit(w)
        save_file(w, str(d / "model.safetensors"))
        cases[case] = str(d)
    arch = tmp_path / "arch"
    shutil.copytree(src, arch)
    config = json.load(open(arch / "config.json"))
    config["architectures"] = ["MambaForCausalLM"]
    json.dump(config, open(arch / "config.json", "w"))
    cases["arch"] = str(arch)

    errors = run_ranks(_expect_errors, 1, cases, str(tmp_path / "out"), tmp_path=tmp_path)[0]
    error = errors.__getitem__

    assert "model.layers.1.self_attn.k_proj.weight" in error("missing")
    assert "model.layers.0.mlp.down_proj.weight" in error("shape") and "(64, 96)" in error("shape")
    assert "model.embed_tokens.weight" in error("larger") and "(300, 64)" in error("larger")
    assert "dtype torch.int64" in error("dtype") and "decoder.final_layernorm.weight" in error("dtype")
    assert "MambaForCausalLM" in error("arch") and "Qwen3ForCausalLM" in error("arch")


# ----------------------------------------------------------------------------- streaming

def _stream_rank(hf_dir, port, n_learners, pp, bucket_bytes, concurrent=False, ep=1):
    """Ranks < n_learners form the learner (PP stages, TP over the rest, or experts over `ep` of
    them); the last rank is the receiver."""
    rank = int(os.environ["RANK"])
    from spice_megatron.bridge.sync_integrity import ReceivedManifest, verify_checksums
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import WeightSyncGroup, send_learner_weights

    if rank == n_learners:  # the receiver: not part of the learner's world
        group = WeightSyncGroup("127.0.0.1", port, pp, pp, 1)
        received, manifest = {}, ReceivedManifest()
        for bucket in receive_all(group, manifest, concurrent=concurrent):
            received.update({name: t.clone() for name, t in bucket})
        checked = verify_checksums(received.items(), manifest)
        tampered = dict(received)
        tampered["model.norm.weight"] = tampered["model.norm.weight"] + 1e-3
        try:
            verify_checksums(tampered.items(), manifest)
            error = None
        except Exception as e:
            error = str(e)
        group.close()
        return received, checked, manifest.version, error
    os.environ["WORLD_SIZE"] = str(n_learners)
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    tp = n_learners // pp if ep == 1 else 1
    learner = learner_from_hf(hf_dir, ParallelConfig(tp, pp, expert_parallel=ep), OptimConfig(), PolicyTrainConfig())
    group = None
    if learner.layout.tp_rank == 0 and learner.layout.dp_rank == 0:
        group = WeightSyncGroup("127.0.0.1", port, learner.layout.pp_rank, pp, 1)
    largest = max(p.numel() * p.element_size() for p in learner.model.parameters()) * learner.layout.tp
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = send_learner_weights(learner, group, version=3, bucket_bytes=bucket_bytes)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    model_bytes = sum(p.numel() * p.element_size() for p in learner.model.parameters())
    if group:
        group.close()
    if report is None:
        return None
    return {"report": report, "peak": peak, "largest": largest, "model_bytes": model_bytes}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_streaming_to_a_receiver_gives_identical_weights(tmp_path):
    config = tiny_hf_config("qwen3", tied=False, vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8,
                            num_kv_heads=4, head_dim=64, intermediate_size=1536)
    d = make_tiny_hf_model(str(tmp_path / "medium"), config, seed=5)
    bucket = 4 * 2**20
    # TP=2 x PP=2: each stage's TP rank 0 gathers its peer's shards straight into its buckets; the
    # receiver takes both stages at once (one thread per stage, as engines do over NCCL)
    results = run_ranks(_stream_rank, 5, d, free_port(), 4, 2, bucket, True, tmp_path=tmp_path)
    (received, checked, version, tamper_error), senders = results[4], [results[0], results[2]]
    assert results[1] is None and results[3] is None  # the TP peers only send their shards
    original = hf_weights(d)
    assert received.keys() == original.keys() and checked == len(original) and version == 3
    assert "model.norm.weight" in tamper_error and "differs" in tamper_error
    assert all(torch.equal(received[k], original[k]) for k in original)
    for s in senders:
        r = s["report"]
        assert r.version == 3 and r.buckets >= 2 and r.bytes > 0 and r.seconds > 0
        # the sender never holds its stage: at most one bucket plus the largest tensor (+ allocator slack)
        assert s["peak"] <= bucket + s["largest"] + 16 * 2**20, (s["peak"], s["model_bytes"])
    assert sum(s["report"].tensors for s in senders) == len(original)


@pytest.mark.multiprocess
def test_streaming_experts_at_ep2_gives_identical_weights(tmp_path):
    """Expert parallelism: EP rank 1 (data-parallel rank 1) sends its experts to the stage's
    sender, which streams every expert under its global HF name; small buckets keep them full."""
    d = make_tiny_hf_model(str(tmp_path / "moe"), tiny_hf_config("qwen3_moe"), seed=4)
    results = run_ranks(_stream_rank, 3, d, free_port(), 2, 1, 64 * 2**10, False, 2, tmp_path=tmp_path)
    (received, checked, version, _), sender = results[2], results[0]
    assert results[1] is None
    original = hf_weights(d)
    assert received.keys() == original.keys() and checked == len(original) and version == 3
    assert all(torch.equal(received[k], original[k]) for k in original)
    assert sender["report"].buckets >= 2 and sender["report"].tensors == len(original)


def _dying_receiver_rank(hf_dir, port):
    """Ranks 0-1: a TP=2 learner; rank 2: a receiver that takes one bucket and goes away."""
    rank = int(os.environ["RANK"])
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import WeightSyncGroup, send_learner_weights

    if rank == 2:
        group = WeightSyncGroup("127.0.0.1", port, 1, 1, 1, timeout_s=60)
        next(iter(receive_all(group)))
        group.close()  # the engine is gone: its sockets close
        return "left"
    os.environ["WORLD_SIZE"] = "2"
    import torch.distributed as dist

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    learner = learner_from_hf(hf_dir, ParallelConfig(2, 1), OptimConfig(), PolicyTrainConfig())
    group = WeightSyncGroup("127.0.0.1", port, 0, 1, 1, timeout_s=60) if learner.layout.tp_rank == 0 else None
    try:
        send_learner_weights(learner, group, version=1, bucket_bytes=2**20)
        outcome = "sent"
    except Exception as e:  # noqa: BLE001
        outcome = f"failed: {type(e).__name__}"
    # both TP ranks went through every gather: the learner's next collective still matches up
    t = torch.ones(1)
    dist.all_reduce(t)
    return outcome, float(t.item())


@pytest.mark.multiprocess
def test_a_receiver_dying_mid_sync_fails_the_sender_and_keeps_tp_ranks_in_step(tmp_path):
    config = tiny_hf_config("qwen3", tied=False, vocab_size=4096, hidden_size=256, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=64, intermediate_size=768)
    d = make_tiny_hf_model(str(tmp_path / "small"), config, seed=3)
    sender, peer, receiver = run_ranks(_dying_receiver_rank, 3, d, free_port(), tmp_path=tmp_path, timeout=300)
    assert receiver == "left"
    assert sender[0].startswith("failed") and sender[1] == 2.0
    assert peer == ("sent", 2.0)


def _placed_back(name: str, hf_name: str, shards: list, spec) -> dict:
    """The HF tensors rebuilt from the TP (or ETP) `shards` of megatron parameter `name`, placed in
    reverse rank order into NaN-filled tensors; `hf_name`: its global name (layer, expert)."""
    from spice_megatron.bridge.mapping import full_shape, hf_outputs, place_shard

    n = len(shards)
    outputs = hf_outputs(hf_name, full_shape(name, tuple(shards[0].shape), n), spec)
    full = [torch.full(shape, float("nan")) for _, shape in outputs]
    for r in reversed(range(n)):
        place_shard(name, shards[r], r, n, spec, full)
    return dict(zip((x for x, _ in outputs), full))


def _random_hf(spec, keep=lambda name: True) -> dict:
    from spice_megatron.bridge.mapping import expected_hf_shapes

    torch.manual_seed(0)
    return {name: torch.randn(shape) for name, shape in expected_hf_shapes(spec).items() if keep(name)}


def _reader(hf: dict):
    return lambda name, dim, start, stop: hf[name] if dim is None else hf[name].narrow(dim, start, stop - start)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_tp4_shards_placed_back_rebuild_every_hf_tensor(family):
    """Export's placement is the exact inverse of import's slicing, at a TP wider than the
    multi-process tests use (4 KV groups over 4 ranks, 2 query heads per group)."""
    from spice_megatron.bridge.mapping import ShardRanks, megatron_shard
    from spice_megatron.families import model_spec_from_hf

    spec = model_spec_from_hf(tiny_hf_config(family, num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=96))
    hf = _random_hf(spec)
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if spec.qk_norm:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    if spec.qkv_bias:
        per_layer += ["self_attention.linear_qkv.bias"]
    names += [f"decoder.layers.{i}.{rest}" for i in range(spec.num_layers) for rest in per_layer]
    rebuilt = {}
    for name in names:
        rebuilt.update(_placed_back(name, name, [megatron_shard(name, spec, ShardRanks(r, 4), 0, _reader(hf))
                                                 for r in range(4)], spec))
    assert rebuilt.keys() == hf.keys()
    assert all(torch.equal(rebuilt[k], hf[k]) for k in hf), [k for k in hf if not torch.equal(rebuilt[k], hf[k])]


def test_expert_shards_placed_back_rebuild_every_hf_tensor():
    """The same for experts and routers at EP=4 x ETP=2, under both megatron namings (the local
    spec's local_experts.{i}.linear_fc1 and TE's grouped linear_fc1.weight{i})."""
    from spice_megatron.bridge.mapping import ShardRanks, megatron_shard, renumber_expert
    from spice_megatron.families import model_spec_from_hf

    spec = model_spec_from_hf(tiny_hf_config("qwen3_moe", num_layers=2, mlp_only_layers=(1,)))
    hf = _random_hf(spec, keep=lambda n: ".mlp." in n and "layers.0." in n)
    ep, etp, per = 4, 2, 2
    fcs = ("linear_fc1", "linear_fc2")
    names = ["decoder.layers.0.mlp.router.weight"]
    names += [f"decoder.layers.0.mlp.experts.local_experts.{i}.{fc}.weight" for i in range(per) for fc in fcs]
    names += [f"decoder.layers.0.mlp.experts.{fc}.weight{i}" for i in range(per) for fc in fcs]
    rebuilt = {}
    for name in names:
        for e in range(ep):
            shards = [megatron_shard(name, spec, ShardRanks(ep_rank=e, ep=ep, etp_rank=r, etp=etp), 0, _reader(hf))
                      for r in range(etp)]
            rebuilt.update(_placed_back(name, renumber_expert(name, e * per), shards, spec))
    assert rebuilt.keys() == hf.keys()
    assert all(torch.equal(rebuilt[k], hf[k]) for k in hf), [k for k in hf if not torch.equal(rebuilt[k], hf[k])]


def test_checksums_are_exact_and_position_sensitive():
    from spice_megatron.bridge.sync_integrity import tensor_checksum

    a = torch.randn(300, 7)
    assert tensor_checksum(a) == tensor_checksum(a.clone())
    assert tensor_checksum(a.T.contiguous()) != tensor_checksum(a)  # same values, other layout
    b = a.clone()
    b[17, 3] = torch.nextafter(b[17, 3], torch.tensor(1e9))  # one ulp
    assert tensor_checksum(b) != tensor_checksum(a)
    assert tensor_checksum(a.bfloat16()) != tensor_checksum(a)
    assert tensor_checksum(torch.zeros(3)) != tensor_checksum(torch.zeros(4))
    # sizes that are not whole 32-bit words, and views that do not start on one
    c = torch.randn(9999).bfloat16()
    d = c.clone()
    d[-1] = -d[-1]
    assert tensor_checksum(c) != tensor_checksum(d)
    assert tensor_checksum(c[1:]) == tensor_checksum(c[1:].clone())
    assert tensor_checksum(c[1:]) != tensor_checksum(c[:-1])
    # large enough for several blocks and a partial last chunk
    e = torch.randn(3 * 2**20 + 5)
    f = e.clone()
    f[2**20 + 17] += 1
    assert tensor_checksum(e) == tensor_checksum(e.clone()) != tensor_checksum(f)


def _source_rank(hf_dir, tp, pp):
    """vLLM's WeightSource contract on a TP x PP learner: metadata() describes the whole model on
    every rank; iteration yields exactly this rank's held names, in metadata order."""
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.bridge.trainer_transfer import MegatronStageSource
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    learner = learner_from_hf(hf_dir, ParallelConfig(tp, pp), OptimConfig(), PolicyTrainConfig())
    source = MegatronStageSource(learner)
    meta = [(m.name, str(m.dtype), m.shape) for m in source.metadata()]
    yielded = [(name, t.clone()) for name, t in source]
    return meta, sorted(source.held_names()), yielded, learner.layout.pp_rank, source.nbytes


@pytest.mark.multiprocess
def test_the_megatron_weight_source_meets_vllms_contract(tiny_models, tmp_path):
    from spice_megatron.bridge.mapping import expected_hf_shapes
    from spice_megatron.families import model_spec_from_hf

    d = tiny_models["qwen3_tied"]  # the last stage skips its copy of the tied embedding
    results = run_ranks(_source_rank, 4, d, 2, 2, tmp_path=tmp_path)
    original = hf_weights(d)
    shapes = expected_hf_shapes(model_spec_from_hf(d))
    metas = [r[0] for r in results]
    assert all(m == metas[0] for m in metas)  # the same whole-model metadata on every rank
    assert {n for n, _, _ in metas[0]} == set(shapes) and all(shapes[n] == s for n, _, s in metas[0])
    order = [n for n, _, _ in metas[0]]
    stage0 = order.index("model.layers.0.input_layernorm.weight")
    assert order.index("model.embed_tokens.weight") < stage0 < order.index("model.norm.weight")
    for meta, held, yielded, pp_rank, nbytes in results:
        names = [n for n, _ in yielded]
        assert sorted(names) == held  # TP rank 0 of each stage yields its stage; TP peers hold nothing
        assert names == [n for n in order if n in set(names)]  # in metadata order
        assert all(torch.equal(t, original[n]) for n, t in yielded)
        assert nbytes == sum(t.numel() * t.element_size() for t in original.values())
    assert sorted(n for r in results for n in r[1]) == sorted(shapes)  # every tensor held exactly once


def _every_rank_rank(hf_dir, tp, pp):
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.bridge.trainer_transfer import EveryRankSource, MegatronStageSource
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig

    learner = learner_from_hf(hf_dir, ParallelConfig(tp, pp), OptimConfig(), PolicyTrainConfig())
    source = EveryRankSource(MegatronStageSource(learner))
    return ([m.name for m in source.metadata()], [(name, t.clone()) for name, t in source], source.largest_tensor_bytes,
            source.checksums)


@pytest.mark.multiprocess
def test_the_ipc_source_gives_every_rank_the_whole_model_in_metadata_order(tiny_models, tmp_path):
    """vLLM's ipc backend merges each rank's handles by index, so every rank of a TP x PP learner
    must yield every whole HF tensor in the same order (each engine worker loads the copy on its GPU)."""
    d = tiny_models["qwen3_tied"]
    original = hf_weights(d)
    from spice_megatron.bridge.sync_integrity import tensor_checksum

    results = run_ranks(_every_rank_rank, 4, d, 2, 2, tmp_path=tmp_path)
    for order, yielded, largest, _ in results:
        assert [n for n, _ in yielded] == order and sorted(order) == sorted(original)
        assert all(torch.equal(t, original[n]) for n, t in yielded)
        assert largest == max(t.numel() * t.element_size() for t in original.values())
    # rank 0 (the one that drives the engines) checksums what it shares, for the engines to check
    assert results[0][3] == {n: tensor_checksum(t) for n, t in original.items()}
    assert all(r[3] is None for r in results[1:])


class FakeCuda:
    """A stand-in for torch.cuda's stream and event API (no GPU here), recording the calls: a
    per-thread current stream, events recorded on a stream, waits, record_stream."""

    def __init__(self):
        import threading

        self.log, self._local = [], threading.local()

    def current_stream(self, device=None):
        import threading

        name = getattr(self._local, "stream", None) or f"stream-of-{threading.current_thread().name}"
        cuda = self

        class Stream:
            def wait_event(self, event):
                cuda.log.append(("wait", name, event.recorded_on))

        s = Stream()
        s.name = name
        return s

    def Event(self):  # noqa: N802 - torch.cuda's name
        cuda = self

        class Event:
            recorded_on = None

            def record(self, stream):
                self.recorded_on = stream.name
                cuda.log.append(("record", stream.name))

        return Event()


def test_a_bucket_received_on_another_thread_is_waited_for_on_the_consumers_stream():
    """The receiving thread records an event after the broadcast; the consumer's stream waits on
    that event (not on its own stream) before reading, and record_stream marks the bucket as used
    by the consumer's stream (before the fix: no event, no wait, no record_stream)."""
    import threading

    from spice_megatron.bridge.stream_handover import StreamHandover

    cuda = FakeCuda()
    recorded = []

    class Tensor:
        def record_stream(self, stream):
            recorded.append(stream.name)

    box = {}
    t = threading.Thread(target=lambda: box.update(h=StreamHandover.mark(torch.device("cuda", 0), cuda)),
                         name="spice-recv-stage1")
    t.start()
    t.join()
    cuda._local.stream = "vllm-worker-stream"  # the consumer runs on vLLM's own stream
    box["h"].to_current_stream([Tensor(), Tensor()])
    assert cuda.log == [("record", "stream-of-spice-recv-stage1"),
                        ("wait", "vllm-worker-stream", "stream-of-spice-recv-stage1")]
    assert recorded == ["vllm-worker-stream", "vllm-worker-stream"]
    # off CUDA (gloo's wait blocks the host) there is nothing to hand over
    StreamHandover.mark(torch.device("cpu"), cuda).to_current_stream([Tensor()])
    assert len(cuda.log) == 2 and len(recorded) == 2


def _ordered_sync_rank(port, stages, receivers):
    """Ranks < stages send a stage's 24 small tensors (several buckets); the others receive
    concurrently and record the stage of each broadcast in the order they issue it."""
    import threading

    from spice_megatron.bridge import weight_sync
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import BucketSender, WeightSyncGroup

    rank = int(os.environ["RANK"])
    group = WeightSyncGroup("127.0.0.1", port, rank, stages, receivers, backend="gloo", timeout_s=120)
    if rank < stages:
        sender = BucketSender(group, version=1, bucket_bytes=256 << 10)
        for i in range(24):
            sender.reserve([(f"stage{rank}.t{i}", (32 << 10,), torch.float32)])[0].fill_(rank * 100 + i)
        sender.close()
        group.close()
        return None
    order, lock = [], threading.Lock()
    original = weight_sync.WeightSyncGroup.broadcast

    def recorded(self, tensor, stage, async_op=False):
        with lock:
            order.append(stage)
        return original(self, tensor, stage, async_op)

    weight_sync.WeightSyncGroup.broadcast = recorded
    received = {name: float(t[0]) for bucket in receive_all(group, concurrent=True) for name, t in bucket}
    group.close()
    return order, received


@pytest.mark.multiprocess
def test_every_engine_worker_issues_the_stages_receives_in_the_same_order(tmp_path):
    """With one receiving thread per stage, two engine workers issued the
    stages' broadcasts in different orders from the 2nd collective on (NCCL, several communicators
    on one device: a deadlock risk). One thread, a fixed interleave: the same order on every worker."""
    results = run_ranks(_ordered_sync_rank, 4, free_port(), 2, 2, tmp_path=tmp_path, timeout=300)
    (order_a, got_a), (order_b, got_b) = results[2], results[3]
    assert order_a == order_b and set(order_a) == {0, 1}
    # stage 0's membership verdict and whole first bucket, then stage 1's
    assert order_a[:6] == [0] * 6 and order_a[6:12] == [1] * 6
    assert got_a == got_b == {f"stage{s}.t{i}": float(s * 100 + i) for s in range(2) for i in range(24)}


def test_concurrent_receive_holds_at_most_a_bounded_number_of_buckets(monkeypatch):
    """N7: one thread per pipeline stage used to hold a queued and an arriving bucket each (2 x PP
    buckets on the engine GPU). With RECEIVE_AHEAD slots, a stage waits for the consumer first.
    Stage senders are stood in for by generators that allocate through the same hook."""
    import threading
    import time
    from types import SimpleNamespace

    from spice_megatron.bridge import weight_receive

    alive, most, lock = [0], [0], threading.Lock()

    def fake_stage(group, stage, manifest, reuse_buffer=False, before_alloc=None, key=None, max_bytes=0):
        for k in range(5):
            before_alloc(1024)
            with lock:
                alive[0] += 1
                most[0] = max(most[0], alive[0])
            yield [(f"stage{stage}.t{k}", torch.zeros(1))]

    monkeypatch.setattr(weight_receive, "receive_stage", fake_stage)
    group = SimpleNamespace(num_stages=4, device=torch.device("cpu"))
    manifest = weight_receive.ReceivedManifest()
    names = []
    for bucket in weight_receive.receive_all(group, manifest, concurrent=True, ahead=2):
        time.sleep(0.01)  # the consumer loads it; the stage threads run ahead meanwhile
        names += [n for n, _ in bucket]
        with lock:
            alive[0] -= 1
    assert sorted(names) == sorted(f"stage{s}.t{k}" for s in range(4) for k in range(5))
    assert most[0] <= 2 and manifest.most_buffered == 2
    # a consumer that stops early releases the waiting stage threads
    stream = weight_receive.receive_all(group, weight_receive.ReceivedManifest(), concurrent=True, ahead=1)
    next(stream)
    stream.close()
