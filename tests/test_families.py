"""spice_megatron/families/: one module per model family, registered by its architecture, and no
family named anywhere else in the code that builds, maps or plans a model."""
from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from spice_megatron.data.offline_assets import tiny_hf_config
from spice_megatron.families import FAMILIES, UnsupportedModelError, family_named, model_spec_from_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [f.name for f in FAMILIES.values()]
# the generic code: it reads a model by ModelSpec's features (recipes, known_models.py, offline_assets.py,
# tools/ and the tests name families as data: which model to build or plan)
GENERIC = ["spice_megatron/policy", "spice_megatron/bridge", "spice_megatron/rollout", "spice_megatron/plan/planner.py",
           "spice_megatron/plan/memory.py", "spice_megatron/plan/costs.py", "spice_megatron/plan/choice.py",
           "spice_megatron/bridge/preflight.py", "spice_megatron/cli/convert.py", "spice_megatron/trainer.py"]


def test_six_families_one_module_each():
    assert NAMES == ["qwen3", "llama", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen2"]
    for family in FAMILIES.values():
        assert os.path.exists(os.path.join(ROOT, "spice_megatron", "families", f"{family.name}.py"))
        assert family.parse.__module__ in (f"spice_megatron.families.{family.name}", "spice_megatron.families.spec")
        assert family.tiny.__module__ == f"spice_megatron.families.{family.name}"


@pytest.mark.parametrize("name", NAMES)
def test_each_family_parses_its_tiny_config_by_architecture_and_by_model_type(name):
    family = family_named(name)
    config = tiny_hf_config(name)
    spec = model_spec_from_hf(config)
    assert spec.family is family and spec.architecture == family.architecture
    assert (spec.moe is not None, spec.mla is not None) == (family.experts, family.mla)
    by_type = model_spec_from_hf({k: v for k, v in config.items() if k != "architectures"})
    assert dataclasses.replace(by_type, hf_config=config) == spec


def test_an_unknown_architecture_names_every_supported_one():
    with pytest.raises(UnsupportedModelError, match="'MistralForCausalLM' is not supported; supported: "
                                                    + ", ".join(sorted(FAMILIES))):
        model_spec_from_hf({**tiny_hf_config("qwen3"), "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="family: unknown 'mistral'"):
        family_named("mistral")


def test_no_family_is_named_outside_families():
    """In code, not prose: no string that is a family's name or architecture, no identifier that
    names one (a docstring may say which models a feature serves)."""
    names = {*NAMES, *FAMILIES}
    found = []
    for target in GENERIC:
        path = os.path.join(ROOT, target)
        files = [path] if path.endswith(".py") else [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns
                                                     if n.endswith(".py")]
        for file in files:
            for node in ast.walk(ast.parse(open(file, encoding="utf-8").read())):
                text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and
                        node.value in names else getattr(node, "id", None) or getattr(node, "arg", None)
                        or getattr(node, "attr", None) or "")
                if text in names or any(w in text.lower() for w in ("glm", "deepseek", "qwen", "llama")):
                    found.append(f"{os.path.relpath(file, ROOT)}:{node.lineno}: {text}")
    assert found == [], "family names outside spice_megatron/families/:\n" + "\n".join(found)


# Conditionals on a model's features outside families/, per file: today's, a ceiling that only goes
# down. The aim (issue 74) is none: each family declares its HF tensor names and its Megatron
# settings, and the bridge and the learner keep the mechanisms and ask the family.
FEATURES = {"moe", "mla", "qk_norm", "qkv_bias", "yarn", "tied_embeddings", "rope_scaling_factor", "rotary_percent"}
FEATURE_BRANCHES = {
    "spice_megatron/policy/model.py": 13, "spice_megatron/bridge/mapping.py": 11, "spice_megatron/plan/memory.py": 6,
    "tools/bench/bench_weight_sync.py": 5, "spice_megatron/policy/learner.py": 3, "spice_megatron/bridge/export.py": 2,
    "spice_megatron/plan/choice.py": 2, "spice_megatron/policy/activation_memory.py": 2,
    "tools/checks/measure_activations.py": 2, "spice_megatron/plan/costs.py": 1,
}


def _feature_branches(path: str) -> int:
    count = 0
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        tests = node.ifs if isinstance(node, ast.comprehension) else [getattr(node, "test", None)]
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.comprehension)):
            count += sum(any(isinstance(x, ast.Attribute) and x.attr in FEATURES for x in ast.walk(t)) for t in tests)
    return count


def test_feature_branches_outside_families_do_not_grow():
    found = {}
    for top in ("spice_megatron", "tools"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            if os.path.relpath(folder, ROOT).startswith(os.path.join("spice_megatron", "families")):
                continue
            for n in (n for n in names if n.endswith(".py")):
                if count := _feature_branches(os.path.join(folder, n)):
                    found[os.path.relpath(os.path.join(folder, n), ROOT)] = count
    grown = {f: (c, FEATURE_BRANCHES.get(f, 0)) for f, c in found.items() if c > FEATURE_BRANCHES.get(f, 0)}
    assert grown == {}, f"conditionals on model features outside families/ (now, ceiling): {grown}"
