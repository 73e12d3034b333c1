"""The Megatron-Core learner against transformers, across TP / PP / DP layouts (gloo, CPU)."""
import json
import math
import os

import pytest
import torch
from dist_utils import run_ranks

from spice_megatron.config import ConfigError, OptimConfig, ParallelConfig, PolicyTrainConfig
from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config
from spice_megatron.policy.batching import TrainSequence

MODELS = [("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f"{fam}_{'tied' if tied else 'untied'}": make_tiny_hf_model(str(root / f"{fam}_{tied}"),
                                                                         tiny_hf_config(fam, tied), seed=1)
            for fam, tied in MODELS}


def tokens_batch():
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def hf_logits(model_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def train_batch():
    g = torch.Generator().manual_seed(3)
    seqs = []
    for i, (p, c) in enumerate([(3, 5), (4, 2), (2, 6), (5, 3), (3, 3), (2, 1)]):
        ids = torch.randint(0, 256, (p + c,), generator=g).tolist()
        seqs.append(TrainSequence(ids[:p], ids[p:], advantage=[0.7, -0.2, 0.4, -0.9, 0.1, 0.3][i]))
    return seqs


# ----------------------------------------------------------------------------- rank functions

def _logits_rank(model_dirs, layouts):
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.batching import collate

    tokens = tokens_batch()
    seqs = [TrainSequence(t[:4].tolist(), t[4:].tolist()) for t in tokens]
    out = {}
    for tp, pp in layouts:
        for name, d in model_dirs.items():
            learner = learner_from_hf(d, ParallelConfig(tp, pp), OptimConfig(), PolicyTrainConfig())

            def grab(mb, logits):
                return torch.zeros(()), {"logits": gather_from_tensor_model_parallel_region(logits).detach()}

            with torch.no_grad():
                outs = learner._run([collate(seqs, [0, 1], pad_to=learner.seq_multiple)], grab, forward_only=True)
            if outs and learner.layout.tp_rank == 0:
                logits = outs[0]["logits"][:, :tokens.shape[1]]
                out[(tp, pp, name)] = (logits - hf_logits(d, tokens)).abs().max().item()
    return out


def _step_rank(model_dir, layouts):
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for tp, pp in layouts:
        learner = learner_from_hf(model_dir, ParallelConfig(tp, pp), OptimConfig(lr=1e-3, adam_eps=1e-5),
                                  PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16))
        (m,) = learner.train_on_batch(train_batch())
        weights = gathered_hf_state_dict(learner)
        out[(tp, pp, learner.layout.dp)] = (m.loss, m.grad_norm, weights)
    return out


def _checkpoint_rank(model_dir, root, dtype="fp32"):
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.checkpoint import load_checkpoint, save_checkpoint
    from spice_megatron.policy.checkpoint_files import latest_checkpoint
    from spice_megatron.policy.learner import Learner

    optim = OptimConfig(lr=1e-3, adam_eps=1e-5, warmup_steps=2, decay_steps=10, decay_style="cosine")
    train = PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, dtype=dtype)
    batch_a, batch_b = train_batch(), train_batch()[::-1]
    for s in batch_b:
        s.advantage = -s.advantage
    learner = learner_from_hf(model_dir, ParallelConfig(2, 1), optim, train)
    learner.train_on_batch(batch_a)
    save_checkpoint(learner, root, step=1, trainer_state={"cursor": 7})
    reference = learner.train_on_batch(batch_b)[0]
    results = {"reference": (reference.loss, reference.lr)}
    for tp, pp in [(2, 1), (1, 1), (1, 2)]:
        from spice_megatron.families import model_spec_from_hf

        fresh = Learner(model_spec_from_hf(model_dir), ParallelConfig(tp, pp), optim, train)  # random init
        state = load_checkpoint(fresh, latest_checkpoint(root))
        m = fresh.train_on_batch(batch_b)[0]
        results[(tp, pp)] = (m.loss, m.lr, state, fresh.steps)
    return results


def _damaged_checkpoint_rank(model_dir, root):
    """DP=2: two checkpoints, the newest damaged in rank 1's shard; the resume takes the older one."""
    import torch.distributed as dist

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.checkpoint import (
        NoUsableCheckpoint,
        resumable_checkpoint,
        save_checkpoint,
        verify_checkpoint,
    )
    from spice_megatron.policy.learner import Learner
    from spice_megatron.policy.parallel import control_group

    optim, train = OptimConfig(lr=1e-3, adam_eps=1e-5), PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16)
    learner = learner_from_hf(model_dir, ParallelConfig(1, 1), optim, train)
    group = control_group(60)
    fresh = Learner(model_spec_from_hf(model_dir), ParallelConfig(1, 1), optim, train)
    assert resumable_checkpoint(fresh, root, group) == (None, {})  # nothing saved yet
    learner.train_on_batch(train_batch())
    save_checkpoint(learner, root, step=1, trainer_state={"iteration": 1}, keep_last=3)
    reference = learner.train_on_batch(train_batch()[::-1])[0].loss
    save_checkpoint(learner, root, step=2, trainer_state={"iteration": 2}, keep_last=3)
    step2 = os.path.join(root, "step_00000002")
    manifest = json.load(open(os.path.join(step2, "manifest.json")))["files"]
    out = {"manifest": sorted(manifest), "intact": verify_checkpoint(step2)}
    dist.barrier()
    if dist.get_rank() == 0:
        shard = os.path.join(step2, "__1_0.distcp")  # rank 1's shard, truncated after the save
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    dist.barrier()
    path, state = resumable_checkpoint(fresh, root, group)
    out["resumed"] = (os.path.basename(path), state, fresh.train_on_batch(train_batch()[::-1])[0].loss, reference)
    out["after"] = sorted(os.listdir(root)), open(os.path.join(root, "latest")).read().strip()
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(root, "step_00000001", "common.pt"))
    dist.barrier()
    try:
        resumable_checkpoint(fresh, root, group)
        out["none_usable"] = ""
    except NoUsableCheckpoint as e:
        out["none_usable"] = str(e)
    return out


# ----------------------------------------------------------------------------- tests

@pytest.mark.multiprocess
def test_logits_match_transformers_single_rank(tiny_models, tmp_path):
    (res,) = run_ranks(_logits_rank, 1, tiny_models, [(1, 1)], tmp_path=tmp_path)
    assert len(res) == 4 and max(res.values()) < 1e-4, res


@pytest.mark.multiprocess
@pytest.mark.slow
def test_logits_match_transformers_tp2_and_pp2(tiny_models, tmp_path):
    results = run_ranks(_logits_rank, 2, tiny_models, [(2, 1), (1, 2)], tmp_path=tmp_path)
    merged = {k: v for r in results for k, v in r.items()}
    assert len(merged) == 8 and max(merged.values()) < 1e-4, merged


@pytest.mark.multiprocess
@pytest.mark.slow
def test_logits_match_transformers_tp2_x_pp2(tiny_models, tmp_path):
    results = run_ranks(_logits_rank, 4, tiny_models, [(2, 2)], tmp_path=tmp_path)
    merged = {k: v for r in results for k, v in r.items()}
    assert len(merged) == 4 and max(merged.values()) < 1e-4, merged


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_step_is_the_same_at_every_layout(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from spice_megatron.selfplay.loss import drgrpo_token_loss

    model_dir = tiny_models["qwen3_tied"]
    (single,) = run_ranks(_step_rank, 1, model_dir, [(1, 1)], tmp_path=tmp_path)
    multi = run_ranks(_step_rank, 2, model_dir, [(2, 1), (1, 2), (1, 1)], tmp_path=tmp_path)[0]
    ref_loss, ref_norm, ref_w = single[(1, 1, 1)]
    assert set(multi) == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    for layout, (loss, norm, w) in multi.items():
        assert loss == pytest.approx(ref_loss, abs=1e-6), layout
        assert norm == pytest.approx(ref_norm, rel=1e-5), layout
        assert w.keys() == ref_w.keys()
        assert max((w[k] - ref_w[k]).abs().max().item() for k in w) < 2e-6, layout

    # The DrGRPO loss equals a direct computation from full-vocabulary logits.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    for s in train_batch():
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0], -1)
        p = len(s.prompt_ids)
        lp = logp[p - 1:-1].gather(-1, torch.tensor(s.completion_ids)[:, None]).T
        loss, _ = drgrpo_token_loss(lp, torch.tensor([s.advantage]), torch.ones_like(lp), 8, num_sequences=6)
        total += loss.item()
    assert ref_loss == pytest.approx(total, abs=1e-6)
    # and the update moved the weights
    original = hf.state_dict()
    assert max((ref_w[k] - original[k]).abs().max().item() for k in ref_w) > 1e-4


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpoint_resume_reshards(tiny_models, tmp_path, dtype):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_checkpoint_rank, 2, tiny_models["llama_untied"], root, dtype, tmp_path=tmp_path)[0]
    ref_loss, ref_lr = results["reference"]
    for layout in [(2, 1), (1, 1), (1, 2)]:
        loss, lr, state, steps = results[layout]
        # bf16: the same layout resumes exactly; another layout sums its bf16 partial results in
        # another order
        tolerance = 1e-6 if dtype == "fp32" or layout == (2, 1) else 2e-3
        assert loss == pytest.approx(ref_loss, abs=tolerance), layout
        assert lr == pytest.approx(ref_lr), layout  # scheduler restored (warmup step 2 of 2)
        assert state == {"cursor": 7} and steps == 2
    assert sorted(os.listdir(root)) == ["latest", "step_00000001"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_named_and_the_one_before_resumes_exactly(tiny_models, tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_damaged_checkpoint_rank, 2, tiny_models["qwen3_untied"], root, tmp_path=tmp_path)
    for r in results:
        # every file is in the manifest, each rank's shard included (each rank flushed and summed its own)
        assert {"__0_0.distcp", "__1_0.distcp", "layout.json", "trainer_state.json", "scheduler.json",
                "common.pt"} <= set(r["manifest"]) and r["intact"] == ""
        name, state, loss, reference = r["resumed"]
        assert name == "step_00000001" and state == {"iteration": 1}
        assert loss == pytest.approx(reference, abs=1e-6)  # the lost step, taken again from step 1, is the same
        assert r["after"] == (["damaged.step_00000002", "latest", "step_00000001"], "step_00000001")
        assert "step_00000001" in r["none_usable"] and "common.pt is missing" in r["none_usable"]


def test_manifests_checksum_with_crc32c_and_older_crc32_manifests_still_verify(tmp_path, monkeypatch):
    import zlib

    from spice_megatron.policy import checkpoint_files
    from spice_megatron.policy.checkpoint_files import file_entry, verify_checkpoint

    (tmp_path / "a.distcp").write_bytes(b"x" * 100)
    entry = file_entry(str(tmp_path / "a.distcp"))
    assert set(entry) == {"size", "crc32c"}  # google-crc32c is a dependency
    old = {"size": 100, "crc32": zlib.crc32(b"x" * 100)}  # a manifest written before CRC-32C
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"a.distcp": old}}))
    assert verify_checkpoint(str(tmp_path)) == ""
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"a.distcp": entry}}))
    assert verify_checkpoint(str(tmp_path)) == ""
    monkeypatch.setattr(checkpoint_files, "_crc32c_extend", lambda: None)  # an environment without it
    assert "install google-crc32c to verify" in verify_checkpoint(str(tmp_path))
    assert set(file_entry(str(tmp_path / "a.distcp"))) == {"size", "crc32"}


def test_verify_checkpoint_names_the_file_that_differs_from_the_manifest(tmp_path):
    from spice_megatron.policy.checkpoint_files import file_entry, verify_checkpoint

    (tmp_path / "a.distcp").write_bytes(b"x" * 100)
    (tmp_path / "layout.json").write_text("{}")
    assert verify_checkpoint(str(tmp_path)) == ""  # before manifests: its load is the check
    files = {n: file_entry(str(tmp_path / n)) for n in ("a.distcp", "layout.json")}
    (tmp_path / "manifest.json").write_text(json.dumps({"files": files}))
    assert verify_checkpoint(str(tmp_path)) == ""
    assert verify_checkpoint(str(tmp_path), part=1, parts=2) == ""
    (tmp_path / "a.distcp").write_bytes(b"y" * 100)  # same size, other bytes
    assert "a.distcp fails its CRC-32" in verify_checkpoint(str(tmp_path))
    assert verify_checkpoint(str(tmp_path), part=1, parts=2) == ""  # that file is the other part's
    (tmp_path / "a.distcp").write_bytes(b"x" * 10)
    assert "a.distcp has 10 bytes, its manifest says 100" in verify_checkpoint(str(tmp_path))
    os.remove(tmp_path / "a.distcp")
    assert "a.distcp is missing" in verify_checkpoint(str(tmp_path))
    (tmp_path / "manifest.json").write_text("{")
    assert "manifest.json is unreadable" in verify_checkpoint(str(tmp_path))


def test_latest_checkpoint_ignores_an_interrupted_save(tmp_path):
    from spice_megatron.policy.checkpoint_files import latest_checkpoint

    assert latest_checkpoint(str(tmp_path / "none")) is None
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "layout.json").write_text("{}")
    (tmp_path / ".step_00000003.tmp").mkdir()  # killed mid-save
    assert latest_checkpoint(str(tmp_path)).endswith("step_00000002")
    (tmp_path / "latest").write_text("step_00000002\n")
    assert latest_checkpoint(str(tmp_path)).endswith("step_00000002")


def test_distributed_optimizer_is_refused_on_the_torch_fallback():
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.learner import Learner

    with pytest.raises(ConfigError, match="optim.use_distributed_optimizer"):
        Learner(model_spec_from_hf(tiny_hf_config()), ParallelConfig(), OptimConfig(use_distributed_optimizer=True),
                PolicyTrainConfig())


def test_model_spec_errors_name_the_problem():
    from spice_megatron.families import UnsupportedModelError, model_spec_from_hf
    from spice_megatron.policy.model import check_parallel_layout

    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        model_spec_from_hf({**tiny_hf_config(), "architectures": ["GPT2LMHeadModel"]})
    spec = model_spec_from_hf(tiny_hf_config("llama"))
    assert spec.rope_scaling_factor == 8.0 and spec.rope_theta == 500000.0 and spec.family.name == "llama"
    with pytest.raises(ConfigError, match="parallel.tensor_parallel.*num_key_value_heads"):
        check_parallel_layout(spec, tp=4, pp=1)
    with pytest.raises(ConfigError, match="parallel.pipeline_parallel.*num_hidden_layers"):
        check_parallel_layout(spec, tp=1, pp=4)
    qwen2 = model_spec_from_hf(tiny_hf_config("qwen2"))
    assert qwen2.family.qkv_bias and not qwen2.family.qk_norm
    assert qwen2.num_parameters == model_spec_from_hf(tiny_hf_config("llama")).num_parameters + 2 * 16 * (4 + 2 * 2)
    with pytest.raises(UnsupportedModelError, match="use_sliding_window=true"):
        model_spec_from_hf({**tiny_hf_config("qwen2"), "use_sliding_window": True})


def _ppo_rank(model_dir):
    from spice_megatron.bridge.hf_io import learner_from_hf

    learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=5e-2, adam_eps=1e-5),
                              PolicyTrainConfig(max_gen_len=8, steps_per_batch=2, clip_low=0.05, clip_high=0.05))
    seqs = train_batch()
    before = learner.compute_logprobs(seqs)
    metrics = learner.train_on_batch(seqs)
    after = learner.compute_logprobs(seqs)
    for s, lp in zip(seqs, before):  # rollout log-probs from the same weights: the gap is 0 at the first step
        s.rollout_logprobs = lp
    first_gap = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(), PolicyTrainConfig(max_gen_len=8)
                                ).train_on_batch(seqs)[0].logprob_gap
    return [m.as_dict() for m in metrics], before, after, first_gap


@pytest.mark.multiprocess
def test_two_steps_per_batch_use_the_ppo_clip(tiny_models, tmp_path):
    (res,) = run_ranks(_ppo_rank, 1, tiny_models["qwen3_untied"], tmp_path=tmp_path)
    metrics, before, after, first_gap = res
    assert len(metrics) == 2 and [m["sequences"] for m in metrics] == [3, 3]
    assert metrics[0]["clip_fraction"] == 0.0 and metrics[0]["approx_kl"] == pytest.approx(0.0, abs=1e-9)
    # the second mini-batch is scored against the pre-update policy: ratios moved, some clipped
    assert metrics[1]["approx_kl"] > 0 and metrics[1]["clip_fraction"] > 0
    assert [len(x) for x in before] == [5, 2, 6, 3, 3, 1]
    assert any(abs(a - b) > 1e-4 for x, y in zip(before, after) for a, b in zip(x, y))
    assert first_gap == pytest.approx(0.0, abs=1e-6)


def _zero_advantage_rank(model_dir):
    """The same batch with half its advantages zero, trained with and without skipping them, in one
    and in two steps (the PPO path recomputes old log-probs for the trained ones only)."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for steps in (1, 2):
        for skip in (True, False):
            train = PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, steps_per_batch=steps,
                                      skip_zero_advantage=skip)
            learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-2, adam_eps=1e-5), train)
            seqs = train_batch()
            for x in seqs[::2]:
                x.advantage = 0.0
            metrics = learner.train_on_batch(seqs)
            out[(steps, skip)] = ([m.as_dict() for m in metrics], gathered_hf_state_dict(learner))
        zero = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-2, adam_eps=1e-5),
                               PolicyTrainConfig(max_gen_len=8, steps_per_batch=steps))
        batch = train_batch()
        for x in batch:
            x.advantage = 0.0
        out[(steps, "all zero")] = [m.as_dict() for m in zero.train_on_batch(batch)]  # a filler step, no error
    return out


@pytest.mark.multiprocess
def test_zero_advantage_sequences_are_skipped_without_changing_the_step(tiny_models, tmp_path):
    (res,) = run_ranks(_zero_advantage_rank, 1, tiny_models["qwen3_untied"], tmp_path=tmp_path)
    for steps in (1, 2):
        (skipped, w_skip), (full, w_full) = res[(steps, True)], res[(steps, False)]
        assert [m["sequences"] for m in skipped] == [m["sequences"] for m in full] == [6 // steps] * steps
        assert sum(m["trained_sequences"] for m in skipped) == 3 and sum(m["trained_sequences"] for m in full) == 6
        for a, b in zip(skipped, full):  # the DrGRPO loss and gradient are those of the whole mini-batch
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                       rel=1e-5)
        assert max((w_skip[k] - w_full[k]).abs().max().item() for k in w_full) < 1e-6, steps
        # nothing to learn: one sequence (of its one role) still goes through, for the metrics; its loss is 0
        zero = res[(steps, "all zero")]
        assert sum(m["trained_sequences"] for m in zero) == 1 and all(m["loss"] == 0.0 for m in zero)


def _frozen_rank(model_dir, dtype):
    """optim.lr=0 (the learning check's control) next to lr 1e-2 on the same batch."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for lr in (0.0, 1e-2):
        learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=lr, weight_decay=0.1, adam_eps=1e-5),
                                  PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, dtype=dtype))
        before = gathered_hf_state_dict(learner)
        (m,) = learner.train_on_batch(train_batch())
        after = gathered_hf_state_dict(learner)
        out[lr] = (m.as_dict(), max((after[k] - before[k]).abs().max().item() for k in before))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_zero_learning_rate_keeps_the_weights_and_reports_the_steps_loss_without_a_backward(tiny_models, tmp_path,
                                                                                             dtype):
    (res,) = run_ranks(_frozen_rank, 1, tiny_models["qwen3_untied"], dtype, tmp_path=tmp_path)
    (frozen, moved_frozen), (trained, moved_trained) = res[0.0], res[1e-2]
    assert moved_frozen == 0.0 and moved_trained > 1e-4
    assert frozen["loss"] == pytest.approx(trained["loss"], abs=1e-6) and frozen["tokens"] == trained["tokens"]
    assert frozen["grad_norm"] == 0.0 and frozen["clip_fraction"] == trained["clip_fraction"] == 0.0


_RECOMPUTED = (("off", ["mlp"]), ("selective", ["mlp"]), ("selective", ["core_attn"]), ("full", ["mlp"]))


def _recompute_rank(model_dir, pp=1, modes=_RECOMPUTED):
    """One step with the MLPs, core attention or whole layers recomputed in the backward."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for recompute, modules in modes:
        train = PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, recompute=recompute, recompute_modules=modules)
        learner = learner_from_hf(model_dir, ParallelConfig(1, pp), OptimConfig(lr=1e-2, adam_eps=1e-5), train)
        (m,) = learner.train_on_batch(train_batch())
        out[f"{recompute} {modules[0]}"] = (m.loss, m.grad_norm, gathered_hf_state_dict(learner),
                                            learner.tconfig.recompute_granularity)
    return out


@pytest.mark.multiprocess
def test_recomputed_layers_give_the_same_step(tiny_models, tmp_path):
    """On one rank, and at PP=2 (1F1B: a stage recomputes a micro-batch after the next one's
    forward) with every layer recomputed."""
    (res,) = run_ranks(_recompute_rank, 1, tiny_models["qwen3_untied"], tmp_path=tmp_path)
    (pp2, _) = run_ranks(_recompute_rank, 2, tiny_models["qwen3_untied"], 2, (("full", ["mlp"]),),
                         tmp_path=tmp_path)
    res["full mlp pp2"] = pp2["full mlp"]
    loss, norm, weights, granularity = res.pop("off mlp")
    assert granularity is None
    for name, (l2, n2, w2, g2) in res.items():
        assert g2 == name.split()[0], name
        assert l2 == pytest.approx(loss, abs=1e-6) and n2 == pytest.approx(norm, rel=1e-5), name
        assert max((w2[k] - weights[k]).abs().max().item() for k in weights) < 1e-6, name


def _tiny_lr_and_direction_rank(model_dir, layouts):
    """bf16 and fp32 at each layout: (a) a step at lr=1e-9 leaves the loaded HF weights where they
    were; (b) one DrGRPO step at a real lr raises the log-probs of positive-advantage completions
    and lowers those of negative ones."""
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.learner import resolve_dtype

    out = {}
    for tp, pp in layouts:
        for dtype in ("fp32", "bf16"):
            train = PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, dtype=dtype)
            learner = learner_from_hf(model_dir, ParallelConfig(tp, pp), OptimConfig(lr=1e-9, adam_eps=1e-5), train)
            loaded = gathered_hf_state_dict(learner)
            learner.train_on_batch(train_batch())
            stepped = gathered_hf_state_dict(learner)
            drift = None if stepped is None else max((stepped[k].float() - loaded[k].float()).abs().max().item()
                                                     for k in stepped)
            learner = learner_from_hf(model_dir, ParallelConfig(tp, pp), OptimConfig(lr=2e-3, adam_eps=1e-5,
                                                                                     weight_decay=0.0), train)
            seqs = train_batch()
            before = learner.compute_logprobs(seqs)
            learner.train_on_batch(seqs)
            after = learner.compute_logprobs(seqs)
            moved = [sum(a) - sum(b) for a, b in zip(after, before)]
            out[(tp, pp, dtype)] = {"loaded": loaded, "drift": drift, "moved": moved,
                                    "dtypes": {p.dtype for p in learner.model.parameters()},
                                    "want": resolve_dtype(dtype)}
    return out


def _check_tiny_lr_and_direction(results, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    advantages = [s.advantage for s in train_batch()]
    for layout, r in results.items():
        assert r["dtypes"] == {r["want"]}, layout  # uniformly bf16 (or fp32): no fp32 norms next to bf16 linears
        if r["loaded"] is not None:  # the rank that gathers the HF view
            dt = r["want"]
            assert all(torch.equal(v, hf[k].to(dt)) for k, v in r["loaded"].items()), layout
            # before the fix, bf16 started from megatron's random init after the first step (drift 0.16)
            assert r["drift"] <= 1e-6, (layout, r["drift"])
        assert all((m > 0) == (a > 0) for m, a in zip(r["moved"], advantages)), (layout, r["moved"])


@pytest.mark.multiprocess
def test_tiny_lr_keeps_hf_weights_and_a_step_follows_the_advantage_single_rank(tiny_models, tmp_path):
    model_dir = tiny_models["qwen3_untied"]
    (res,) = run_ranks(_tiny_lr_and_direction_rank, 1, model_dir, [(1, 1)], tmp_path=tmp_path)
    _check_tiny_lr_and_direction(res, model_dir)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiny_lr_keeps_hf_weights_and_a_step_follows_the_advantage_tp2_and_pp2(tiny_models, tmp_path):
    model_dir = tiny_models["qwen3_tied"]
    results = run_ranks(_tiny_lr_and_direction_rank, 2, model_dir, [(2, 1), (1, 2)], tmp_path=tmp_path)
    merged = {}
    for r in results:
        for k, v in r.items():
            if k not in merged or v["loaded"] is not None:
                merged[k] = v
    assert len(merged) == 4
    _check_tiny_lr_and_direction(merged, model_dir)


@pytest.mark.gpu
def test_bf16_train_step_on_gpu(tiny_models, tmp_path):
    (res,) = run_ranks(_step_rank, 1, tiny_models["qwen3_tied"], [(1, 1)], tmp_path=tmp_path)
    loss, norm, _ = res[(1, 1, 1)]
    assert torch.isfinite(torch.tensor([loss, norm])).all()


class _DistOptimizerStandIn:
    """Stands in for megatron's DistributedOptimizer, which cannot be built on CPU (its fallback
    Adam does not take megatron's arguments): like 0.16.1, it raises when the sharding type is
    missing or is the default fully_sharded_model_space."""

    def __init__(self):
        self.calls = []

    def sharded_state_dict(self, model_sd, is_loading=False, sharding_type=None, metadata=None):
        from megatron.core.dist_checkpointing.core import CheckpointingException

        kind = (metadata or {}).get("distrib_optim_sharding_type", "fully_sharded_model_space")
        self.calls.append((is_loading, kind))
        if kind == "fully_sharded_model_space":
            raise CheckpointingException("ShardedTensor.flattened_range is not supported.")
        return {"param_state_sharding_type": kind}


def test_distributed_optimizer_checkpoints_ask_for_a_supported_sharding():
    from types import SimpleNamespace

    from spice_megatron.policy.checkpoint import _sharded_state, optimizer_metadata

    optimizer = _DistOptimizerStandIn()
    model = SimpleNamespace(sharded_state_dict=lambda: {})
    learner = SimpleNamespace(optimizer=optimizer, optim_cfg=OptimConfig(use_distributed_optimizer=True),
                              layout=None, model=model, chunks=[model])
    assert learner.optim_cfg.checkpoint_sharding == "dp_reshardable"  # routine saves: no gather
    assert _sharded_state(learner, False, True, False, "dp_reshardable")["optimizer"] == {
        "param_state_sharding_type": "dp_reshardable"}
    _sharded_state(learner, True, True, False, "fully_reshardable")  # a load uses the type the save recorded
    assert optimizer.calls == [(False, "dp_reshardable"), (True, "fully_reshardable")]
    assert optimizer_metadata(SimpleNamespace(optim_cfg=OptimConfig()), "dp_reshardable") is None
    with pytest.raises(ConfigError, match="optim.checkpoint_sharding"):
        OptimConfig(checkpoint_sharding="fully_sharded_model_space").validate()


def test_a_dp_sharded_optimizer_state_loads_only_at_its_model_parallel_layout():
    from types import SimpleNamespace

    from spice_megatron.policy.checkpoint import check_optimizer_resharding

    saved = {"tp": 2, "pp": 1, "dp": 4, "ep": 1, "distributed_optimizer": True, "optimizer_sharding": "dp_reshardable"}
    at = lambda tp, pp, dp, ep=1: SimpleNamespace(tp=tp, pp=pp, dp=dp, ep=ep)  # noqa: E731
    check_optimizer_resharding("ck", saved, at(2, 1, 8), True)  # DP changes: megatron reshards the DP shards
    with pytest.raises(ConfigError, match=r"ck: .*dp_reshardable.*TP=2 PP=1 EP=1.*this run is TP=4 PP=1") as e:
        check_optimizer_resharding("ck", saved, at(4, 1, 2), True)
    assert "fully_reshardable for one checkpoint" in str(e.value)
    with pytest.raises(ConfigError, match="distributed optimizer False"):
        check_optimizer_resharding("ck", saved, at(2, 1, 4), False)
    check_optimizer_resharding("ck", {**saved, "optimizer_sharding": "fully_reshardable"}, at(4, 2, 1), True)
    legacy = {"tp": 2, "pp": 1, "dp": 4}  # before the setting: gathered, loads anywhere
    check_optimizer_resharding("ck", legacy, at(1, 2, 4), True)
    plain = {**saved, "distributed_optimizer": False}  # a non-distributed optimizer's state reshards itself
    check_optimizer_resharding("ck", plain, at(1, 1, 8), False)


def _updates_rank(model_dir, layouts):
    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for tp, pp in layouts:
        learner = learner_from_hf(model_dir, ParallelConfig(tp, pp), OptimConfig(lr=1e-3, adam_eps=1e-5),
                                  PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, trajectories_per_update=2))
        steps = learner.train_on_batch(train_batch())
        out[(tp, pp, learner.layout.dp)] = ([m.as_dict() for m in steps], gathered_hf_state_dict(learner))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_updates_of_k_trajectories_are_the_same_with_and_without_data_parallelism(tiny_models, tmp_path):
    model_dir = tiny_models["qwen3_untied"]
    (single,) = run_ranks(_updates_rank, 1, model_dir, [(1, 1)], tmp_path=tmp_path)
    dp2 = run_ranks(_updates_rank, 2, model_dir, [(1, 1)], tmp_path=tmp_path)[0]
    ref_steps, ref_w = single[(1, 1, 1)]
    steps, w = dp2[(1, 1, 2)]
    # 6 trajectories, 2 per update: 3 optimiser steps; the PPO clip is live from the second on
    assert [m["sequences"] for m in ref_steps] == [2, 2, 2] and len(steps) == 3
    assert ref_steps[0]["approx_kl"] == pytest.approx(0.0, abs=1e-9) and ref_steps[2]["approx_kl"] > 0
    for a, b in zip(ref_steps, steps):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"],
                                                                                                   rel=1e-5)
    assert max((w[k] - ref_w[k]).abs().max().item() for k in w) < 2e-6


def test_trajectories_per_update_sets_the_number_of_steps():
    from types import SimpleNamespace

    from spice_megatron.policy.learner import Learner


    steps = lambda n, per, k=1: Learner.steps_for(  # noqa: E731
        SimpleNamespace(train_cfg=PolicyTrainConfig(trajectories_per_update=per, steps_per_batch=k)), n)
    assert steps(2048, 128) == 16 and steps(2000, 128) == 16 and steps(100, 128) == 1 and steps(129, 128) == 2
    assert steps(2048, 0, 3) == 3
    with pytest.raises(ConfigError, match="train.trajectories_per_update"):
        PolicyTrainConfig(trajectories_per_update=128, steps_per_batch=2).validate()
    with pytest.raises(ConfigError, match="train.trajectories_per_update"):
        PolicyTrainConfig(trajectories_per_update=-1).validate()


def test_learner_refuses_samples_older_than_max_staleness():
    from types import SimpleNamespace

    from spice_megatron.policy.learner import Learner


    learner = SimpleNamespace(train_cfg=PolicyTrainConfig(max_staleness=1))
    fresh = TrainSequence([1], [2, 3], versions=[[4, 0, 1], [5, 1, 2]], role="reasoner")
    Learner.check_staleness(learner, [fresh, TrainSequence([1], [2])], version=5)  # lag 1 (and no spans) is fine
    with pytest.raises(ValueError, match=r"sequence 1 \(challenger\): sampled by weights version 3, the learner is "
                                         r"at 5; train.max_staleness=1"):
        Learner.check_staleness(learner, [fresh, TrainSequence([1], [2], role="challenger", versions=[[3, 0, 1]])], 5)
    learner.train_cfg = PolicyTrainConfig(max_staleness=0)
    with pytest.raises(ValueError, match="max_staleness=0"):
        Learner.check_staleness(learner, [fresh], version=5)


def test_mismatch_metrics_per_role_equal_the_direct_formulas():
    import math

    from spice_megatron.policy.mismatch import mismatch_by_role, mismatch_metrics, mismatch_rows

    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    engine = torch.tensor([[-1.5, -2.0, 0.0], [-2.0, -0.4, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rows = mismatch_rows(lp, None, engine, mask, 2.0).tolist()
    got = mismatch_metrics([mismatch_by_role(rows, ["challenger", "reasoner"])])
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    assert got["challenger/logprob_gap_mean"] == pytest.approx(0.25)
    assert got["challenger/logprob_gap_max"] == pytest.approx(0.5)
    assert got["challenger/k3_kl"] == pytest.approx((k3(0.5) + k3(0.0)) / 2)
    assert got["challenger/tis_capped"] == 0.0
    assert got["reasoner/logprob_gap_mean"] == pytest.approx((1.5 + 0.1) / 2)
    assert got["reasoner/tis_capped"] == 0.5  # exp(1.5) > 2


def _tis_rank(model_dir):
    """fp32 and bf16: with TIS on and the engine's log-probs log(4) below the learner's, every
    weight is capped at 2, so the loss is twice the plain one; with equal log-probs it is the same."""
    import math

    from spice_megatron.bridge.hf_io import learner_from_hf

    out = {}
    for dtype in ("fp32", "bf16"):
        losses = {}
        for mode, shift in (("off", 0.0), ("on_equal", 0.0), ("on_capped", math.log(4.0))):
            train = PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16, dtype=dtype,
                                      importance_sampling="on" if mode != "off" else "off")
            learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(lr=1e-9), train)
            seqs = train_batch()
            for x, lps in zip(seqs, learner.compute_logprobs(seqs)):
                x.rollout_logprobs, x.role = [v - shift for v in lps], "reasoner"
            (m,) = learner.train_on_batch(seqs)
            losses[mode] = m.as_dict()
        out[dtype] = losses
    return out


@pytest.mark.multiprocess
def test_truncated_importance_sampling_in_the_learner_fp32_and_bf16(tiny_models, tmp_path):
    (res,) = run_ranks(_tis_rank, 1, tiny_models["qwen3_untied"], tmp_path=tmp_path)
    for dtype, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        r = res[dtype]
        assert r["on_equal"]["loss"] == pytest.approx(r["off"]["loss"], rel=tol, abs=1e-6), dtype
        assert r["on_capped"]["loss"] == pytest.approx(2 * r["off"]["loss"], rel=tol, abs=1e-6), dtype
        assert r["on_capped"]["reasoner/tis_capped"] == 1.0 and r["on_equal"]["reasoner/tis_capped"] == 0.0
        assert r["on_capped"]["reasoner/logprob_gap_mean"] == pytest.approx(math.log(4.0), rel=tol)
        assert r["on_equal"]["reasoner/k3_kl"] == pytest.approx(0.0, abs=1e-3)


def _uneven_rank(model_dir, splits):
    """Per (first_stage_layers, last_stage_layers) at PP=2 (and PP=1 as (0, 0) on one rank's worth):
    the logits' max |diff| to transformers, and one step's loss, grad norm and gathered weights."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from spice_megatron.bridge.export import gathered_hf_state_dict
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.policy.batching import collate

    tokens = tokens_batch()
    seqs = [TrainSequence(t[:4].tolist(), t[4:].tolist()) for t in tokens]
    out = {}
    for first, last in splits:
        parallel = ParallelConfig(1, 2 if first or last else 1, first_stage_layers=first, last_stage_layers=last)
        learner = learner_from_hf(model_dir, parallel, OptimConfig(lr=1e-3, adam_eps=1e-5),
                                  PolicyTrainConfig(max_gen_len=8, micro_batch_tokens=16))
        with torch.no_grad():
            outs = learner._run([collate(seqs, [0, 1], pad_to=learner.seq_multiple)],
                                lambda mb, lg: (torch.zeros(()), {"l": gather_from_tensor_model_parallel_region(lg)}),
                                forward_only=True)
        gap = (outs[0]["l"][:, :tokens.shape[1]] - hf_logits(model_dir, tokens)).abs().max().item() if outs else None
        (m,) = learner.train_on_batch(train_batch())
        out[(first, last)] = (gap, m.loss, m.grad_norm, gathered_hf_state_dict(learner))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uneven_pipeline_stages_match_transformers_and_step_as_one_stage(tmp_path):
    """3 layers over PP=2 as 1 + 2 (first_stage_layers) and 2 + 1 (last_stage_layers): the logits are
    transformers', a step's loss, grad norm and weights those of one stage."""
    model = make_tiny_hf_model(str(tmp_path / "m"), tiny_hf_config("qwen3", num_layers=3), seed=5)
    (single,) = run_ranks(_uneven_rank, 1, model, [(0, 0)], tmp_path=tmp_path)
    ranks = run_ranks(_uneven_rank, 2, model, [(1, 0), (0, 1)], tmp_path=tmp_path)
    _, ref_loss, ref_norm, ref_w = single[(0, 0)]
    for split in [(1, 0), (0, 1)]:
        gap = next(r[split][0] for r in ranks if r[split][0] is not None)  # the last stage has the logits
        assert gap < 1e-4, (split, gap)
        _, loss, norm, w = next(r[split] for r in ranks if r[split][3] is not None)
        assert loss == pytest.approx(ref_loss, abs=1e-6) and norm == pytest.approx(ref_norm, rel=1e-5), split
        assert w.keys() == ref_w.keys() and max((w[k] - ref_w[k]).abs().max().item() for k in w) < 2e-6, split


def test_uneven_stages_are_checked_where_the_learner_would_refuse_them():
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.model import pipeline_stage_layers

    assert pipeline_stage_layers(94, 4, first=22) == [22, 24, 24, 24]
    assert pipeline_stage_layers(61, 8, first=5, last=8) == [5, 8, 8, 8, 8, 8, 8, 8]
    assert pipeline_stage_layers(3, 2, last=1) == [2, 1]
    with pytest.raises(ConfigError, match="parallel.pipeline_parallel: 4 does not divide num_hidden_layers=94"):
        pipeline_stage_layers(94, 4)
    with pytest.raises(ConfigError, match="first_stage_layers / last_stage_layers: 20 and 0 .* leave 74 for 3"):
        pipeline_stage_layers(94, 4, first=20)
    with pytest.raises(ConfigError, match="parallel.first_stage_layers: needs pipeline_parallel > 1"):
        ParallelConfig(first_stage_layers=2).validate()
    from spice_megatron.policy.model import check_parallel_layout

    check_parallel_layout(model_spec_from_hf(tiny_hf_config("qwen3", num_layers=3)), 1, 2, first_stage_layers=1)
