"""Bad input at every entry point, run as a user would (a subprocess each): exit code 2, stderr's
last line starts with `error:` and names the path, tensor or field, no traceback, and nothing
half-written left behind. CASES is also the table in docs/troubleshooting.md (tools/docs_tables.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = {
    "spice": ["-m", "spice_megatron.cli"],
    "convert_from_hf": [os.path.join(ROOT, "tools", "convert_from_hf.py")],
    "convert_to_hf": [os.path.join(ROOT, "tools", "convert_to_hf.py")],
    "learning_check": [os.path.join(ROOT, "tools", "checks", "learning_check.py")],
    "bench_learner": [os.path.join(ROOT, "tools", "bench", "bench_learner.py")],
    "bench_checkpoint": [os.path.join(ROOT, "tools", "bench", "bench_checkpoint.py")],
    "bench_rollout": [os.path.join(ROOT, "tools", "bench", "bench_rollout.py")],
    "bench_weight_sync": [os.path.join(ROOT, "tools", "bench", "bench_weight_sync.py")],
    "prepare_corpus": [os.path.join(ROOT, "tools", "prepare_corpus.py")],
    "rollout_follower": ["-m", "spice_megatron.rollout.follower"],
}


@dataclass(frozen=True)
class Case:
    id: str
    entry: str  # a key of ENTRY_POINTS
    args: str  # split on spaces after {d} (the fixtures' directory) is filled in
    names: str  # what the error line must name
    what: str  # the bad input, for the docs


CASES = [
    # an HF model directory
    Case("hf_dir_missing", "convert_from_hf", "--model {d}/nope --output {d}/out", "--model {d}/nope",
         "a directory that does not exist"),
    Case("hf_truncated_shard", "convert_from_hf", "--model {d}/trunc --output {d}/out", "{d}/trunc/model.safetensors",
         "a truncated `model.safetensors`"),
    Case("hf_corrupt_header", "convert_from_hf", "--model {d}/garbage --output {d}/out",
         "{d}/garbage/model.safetensors",
         "a shard whose header is not JSON"),
    Case("hf_config_not_json", "convert_from_hf", "--model {d}/badjson --output {d}/out", "{d}/badjson/config.json",
         "a config.json that is not JSON"),
    Case("hf_config_field_missing", "convert_from_hf", "--model {d}/nofield --output {d}/out", "'num_attention_heads'",
         "a config.json without a field the family needs"),
    Case("hf_architecture", "convert_from_hf", "--model {d}/arch --output {d}/out", "GPT2LMHeadModel",
         "an unsupported architecture"),
    Case("hf_rope_scaling", "convert_from_hf", "--model {d}/rope --output {d}/out", "rope_scaling.rope_type='yarn'",
         "an unsupported rope-scaling type"),
    Case("hf_quantization", "convert_from_hf", "--model {d}/quant --output {d}/out",
         "quantization_config: quant_method='awq'",
         "a quantization other than FP8 block scales"),
    Case("hf_index_missing_shard", "convert_from_hf", "--model {d}/index --output {d}/out",
         "{d}/index/model-00002-of-00002.safetensors", "an index naming a shard that is not there"),
    Case("hf_tensor_missing", "convert_from_hf", "--model {d}/notensor --output {d}/out", "'model.norm.weight'",
         "a checkpoint without a tensor the architecture needs"),
    Case("hf_tensor_shape", "convert_from_hf", "--model {d}/shape --output {d}/out",
         "'model.layers.0.input_layernorm.weight'",
         "a tensor whose shape config.json contradicts"),
    Case("hf_no_weights", "convert_from_hf", "--model {d}/noweights --output {d}/out", "{d}/noweights",
         "no safetensors at all"),
    Case("hf_tp_heads", "convert_from_hf", "--model {d}/heads3 --output {d}/out --tp 2", "--tp",
         "TP that does not divide the attention heads"),
    Case("hf_pp_layers", "convert_from_hf", "--model {d}/ok --output {d}/out --pp 3", "--pp",
         "PP that does not divide the layers"),
    Case("hf_uneven_stages", "convert_from_hf", "--model {d}/ok --output {d}/out --pp 2 --first-stage-layers 2",
         "--first-stage-layers / --last-stage-layers", "uneven pipeline stages that leave a stage no layer"),
    Case("hf_ep_dense", "convert_from_hf", "--model {d}/ok --output {d}/out --ep 2", "--ep",
         "EP for a model without experts"),
    Case("hf_tp_zero", "convert_from_hf", "--model {d}/ok --output {d}/out --tp 0", "--tp", "a layout size below 1"),
    Case("hf_out_exists", "convert_from_hf", "--model {d}/ok --output {d}/existing", "--output {d}/existing",
         "an output directory that exists, without --overwrite"),
    Case("hf_out_parent", "convert_from_hf", "--model {d}/ok --output {d}/no/such/out", "--output {d}/no/such/out",
         "an output whose parent does not exist"),
    # a Megatron checkpoint
    Case("ckpt_missing", "convert_to_hf", "--model {d}/nope --output {d}/out", "--model {d}/nope",
         "a directory that does not exist"),
    Case("ckpt_no_layout", "convert_to_hf", "--model {d}/ckpt_nolayout --output {d}/out", "{d}/ckpt_nolayout",
         "no step directory with a layout.json"),
    Case("ckpt_layout_not_json", "convert_to_hf", "--model {d}/ckpt_badlayout/step_00000000 --output {d}/out",
         "{d}/ckpt_badlayout/step_00000000/layout.json", "a layout.json that is not JSON"),
    Case("ckpt_shard_missing", "convert_to_hf", "--model {d}/ckpt_noshard --output {d}/out",
         "{d}/ckpt_noshard/step_00000000/__0_0.distcp", "a rank file the manifest lists, missing"),
    Case("ckpt_shard_truncated", "convert_to_hf", "--model {d}/ckpt_truncshard --output {d}/out",
         "{d}/ckpt_truncshard/step_00000000/__0_0.distcp", "a truncated rank file"),
    Case("ckpt_no_hf_config", "convert_to_hf", "--model {d}/ckpt_nohf/step_00000000 --output {d}/out",
         "{d}/ckpt_nohf/hf/config.json", "a checkpoint root without hf/config.json"),
    Case("ckpt_tp_heads", "convert_to_hf", "--model {d}/ckpt --output {d}/out --tp 3", "--tp",
         "TP that does not divide the attention heads"),
    Case("ckpt_out_exists", "convert_to_hf", "--model {d}/ckpt --output {d}/existing", "--output {d}/existing",
         "an output directory that exists, without --overwrite"),
    # spice
    Case("train_tp_heads", "spice", "train --model {d}/heads3 --output {d}/run parallel.tensor_parallel=2",
         "parallel.tensor_parallel", "a layout the model's heads do not divide (before any rank starts)"),
    Case("train_pp_layers", "spice", "train --model {d}/ok --output {d}/run parallel.pipeline_parallel=3",
         "parallel.pipeline_parallel", "a layout the model's layers do not divide"),
    Case("train_vpp_layers", "spice", "train --model {d}/ok --output {d}/run parallel.pipeline_parallel=2 "
         "parallel.virtual_pipeline=3", "parallel.virtual_pipeline",
         "virtual pipeline stages the layers do not divide"),
    Case("train_cp_shared_prefix", "spice", "train --model {d}/ok --output {d}/run parallel.context_parallel=2 "
         "train.shared_prefix=on", "parallel.context_parallel", "context parallelism with shared-prefix rows"),
    Case("train_recipe", "spice", "train --recipe nope", "--recipe 'nope'", "an unknown recipe"),
    Case("train_override_value", "spice", "train selfplay.batch_docs=abc", "selfplay.batch_docs",
         "an unparsable value"),
    Case("train_override_field", "spice", "train selfplay.no_such_field=1", "selfplay.no_such_field",
         "an unknown field"),
    Case("train_model_missing", "spice", "train --model {d}/nope --output {d}/run", "run.model {d}/nope",
         "a model directory that does not exist"),
    Case("train_model_truncated", "spice", "train --model {d}/trunc --output {d}/run",
         "{d}/trunc/model.safetensors",
         "a truncated shard"),
    Case("train_unknown_flag", "spice", "train --bogus", "--bogus", "an unknown flag"),
    Case("train_engine_model_fp8", "spice", "train --model {d}/fp8 --output {d}/run", "run.model={d}/fp8",
         "an FP8 model for the engines too (they serve a bf16 copy: rollout.model, `spice convert bf16`)"),
    Case("train_engine_model_other", "spice", "train --model {d}/ok --output {d}/run rollout.model={d}/heads3",
         "rollout.model={d}/heads3", "engines on another architecture than the learner's"),
    Case("convert_bf16_unquantized", "spice", "convert bf16 --model {d}/ok --output {d}/out", "{d}/ok",
         "a bf16 copy of a model that is not FP8"),
    Case("plan_pp_layers", "spice", "plan --model {d}/ok parallel.pipeline_parallel=3", "parallel.pipeline_parallel",
         "a fixed layout the learner would refuse"),
    Case("plan_model_missing", "spice", "plan --model {d}/nope", "--model {d}/nope",
         "a model directory that does not exist"),
    Case("audit_missing", "spice", "audit {d}/nope", "{d}/nope", "a run directory that does not exist"),
    Case("curves_missing", "spice", "curves {d}/nope", "{d}/nope", "a run directory that does not exist"),
    Case("eval_model_missing", "spice", "eval --model {d}/nope", "--model {d}/nope", "a model that does not exist"),
    Case("corpus_source_missing", "spice", "corpus --source {d}/nope.jsonl", "{d}/nope.jsonl",
         "a corpus file that does not exist"),
    Case("prepare_recipe", "spice", "prepare --recipe nope", "--recipe 'nope'", "an unknown recipe"),
    Case("coevolution_checkpoints", "spice", "coevolution --checkpoints {d}/nope", "{d}/nope",
         "a checkpoint that does not exist"),
    # tools
    Case("learning_check_seeds", "learning_check", "--seeds a,b", "--seeds", "seeds that are not integers"),
    Case("learning_check_model", "learning_check", "--model {d}/nope", "--model {d}/nope",
         "a model that does not exist"),
    Case("bench_learner_cases", "bench_learner", "--cases nope", "--cases", "an unknown benchmark case"),
    Case("bench_checkpoint_repeats", "bench_checkpoint", "--repeats 0", "--repeats", "a count below 1"),
    Case("bench_rollout_model", "bench_rollout", "--model {d}/nope", "--model {d}/nope", "a model that does not exist"),
    Case("bench_weight_sync_layers", "bench_weight_sync", "--layers x", "--layers", "a count that is not a number"),
    Case("prepare_corpus_out", "prepare_corpus", "--data {d}/a_file", "--data {d}/a_file",
         "an output path that is a file"),
    Case("launch_recipe", "spice", "launch --recipe nope", "--recipe 'nope'", "an unknown recipe"),
    Case("launch_slurm_flags", "spice", "launch --recipe tiny_cpu --executor slurm", "--account",
         "Slurm without the flags it needs"),
    Case("follower_span", "rollout_follower", "--model {d}/ok --node-rank 1 --nnodes 3 --tensor-parallel-size 2",
         "--nnodes 3", "an engine span its workers do not divide"),
]


def _make_fixtures(d: str) -> None:
    """Every damaged input the cases name, from one tiny model and its converted checkpoint."""
    from safetensors.torch import load_file, save_file

    from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config

    ok = make_tiny_hf_model(os.path.join(d, "ok"), tiny_hf_config("qwen3"))
    make_tiny_hf_model(os.path.join(d, "heads3"), tiny_hf_config("qwen3", num_heads=3, num_kv_heads=3, hidden_size=48))
    weights = load_file(os.path.join(ok, "model.safetensors"))

    def variant(name: str, config: dict | str | None = None, tensors: dict | None = None,
                raw: bytes | None = None) -> str:
        path = os.path.join(d, name)
        shutil.copytree(ok, path)
        if config is not None:
            with open(os.path.join(path, "config.json"), "w") as f:
                f.write(config if isinstance(config, str) else json.dumps(config))
        if tensors is not None:
            save_file(tensors, os.path.join(path, "model.safetensors"))
        if raw is not None:
            with open(os.path.join(path, "model.safetensors"), "wb") as f:
                f.write(raw)
        return path

    config = json.load(open(os.path.join(ok, "config.json")))
    with open(os.path.join(ok, "model.safetensors"), "rb") as f:
        variant("trunc", raw=f.read(1000))
    variant("garbage", raw=(64).to_bytes(8, "little") + b"\x00\xff" * 40)
    variant("badjson", config='{"architectures": ["Qwen3ForCausalLM"],')
    variant("nofield", config={k: v for k, v in config.items() if k != "num_attention_heads"})
    variant("arch", config={**config, "architectures": ["GPT2LMHeadModel"]})
    variant("rope", config={**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    variant("quant", config={**config, "quantization_config": {"quant_method": "awq", "bits": 4}})
    variant("fp8", config={**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                             "weight_block_size": [16, 16]}})
    variant("notensor", tensors={k: v for k, v in weights.items() if k != "model.norm.weight"})
    variant("shape", tensors={**weights,
                              "model.layers.0.input_layernorm.weight": weights["model.norm.weight"][:10].clone()})
    index = variant("index")
    os.replace(os.path.join(index, "model.safetensors"), os.path.join(index, "model-00001-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in weights}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    with open(os.path.join(index, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.remove(os.path.join(variant("noweights"), "model.safetensors"))
    os.makedirs(os.path.join(d, "existing"))
    open(os.path.join(d, "existing", "keep.txt"), "w").close()
    open(os.path.join(d, "a_file"), "w").close()

    ckpt = os.path.join(d, "ckpt")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_from_hf.py"), "--model", ok,
                        "--output", ckpt], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    step = "step_00000000"

    def damaged(name: str) -> str:
        shutil.copytree(ckpt, os.path.join(d, name))
        return os.path.join(d, name, step)

    os.remove(os.path.join(damaged("ckpt_nolayout"), "layout.json"))
    with open(os.path.join(damaged("ckpt_badlayout"), "layout.json"), "w") as f:
        f.write("{tp: 1")
    os.remove(os.path.join(damaged("ckpt_noshard"), "__0_0.distcp"))
    with open(os.path.join(damaged("ckpt_truncshard"), "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    damaged("ckpt_nohf")
    os.remove(os.path.join(d, "ckpt_nohf", "hf", "config.json"))


def _command(case: Case, d: str) -> list[str]:
    return [sys.executable, *ENTRY_POINTS[case.entry], *case.args.format(d=d).split(" ")]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    """Every case run once, two at a time, from a working directory of its own."""
    d = str(tmp_path_factory.mktemp("bad_input"))
    _make_fixtures(d)
    env = {**os.environ, "SPICE_DATA_DIR": os.path.join(d, "data")}
    env.pop("SPICE_DEBUG", None)

    def run(case: Case) -> tuple[str, tuple[subprocess.CompletedProcess, str]]:
        cwd = os.path.join(d, "cwd", case.id)
        os.makedirs(cwd)
        r = subprocess.run(_command(case, d), capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
        return case.id, (r, d)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, CASES))


def test_the_matrix_has_at_least_25_cases_over_every_entry_point():
    assert len({c.id for c in CASES}) == len(CASES) >= 25
    assert {c.entry for c in CASES} == set(ENTRY_POINTS)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_it_and_exit_code_2(case: Case, outcomes):
    r, d = outcomes[case.id]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), r.stderr[-3000:]
    assert case.names.format(d=d) in lines[-1], lines[-1]
    assert sum(line.startswith("error: ") for line in lines) == 1, r.stderr[-3000:]
    # nothing half-written: no output, no OUT.partial, an existing output untouched
    assert not os.path.exists(os.path.join(d, "out")) and not os.path.exists(os.path.join(d, "out.partial"))
    assert os.listdir(os.path.join(d, "existing")) == ["keep.txt"]


@pytest.mark.slow
def test_spice_debug_shows_the_traceback_before_the_line(tmp_path):
    env = {**os.environ, "SPICE_DEBUG": "1"}
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "audit", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")


RANK_ERROR = """
import os, time
from spice_megatron.entry import UserError, run_entry_point

def main():
    if os.environ["RANK"] == "1":
        raise UserError("model.field: rank 1 found it")
    time.sleep(120)  # rank 0 waits, as in a collective, until torchrun stops it

run_entry_point(main)
"""


@pytest.mark.multiprocess
def test_a_user_error_on_one_rank_is_one_line_from_the_launcher(tmp_path):
    """What a relaunched command's ranks find: the line once, exit 2, no torchrun traceback, and
    the rank still waiting is stopped."""
    from spice_megatron.torchrun import free_port

    script = tmp_path / "ranks.py"
    script.write_text(RANK_ERROR)
    r = subprocess.run([sys.executable, "-m", "spice_megatron.torchrun", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script)],
                       capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: model.field: rank 1 found it"
    assert r.stderr.count("rank 1 found it") == 1
