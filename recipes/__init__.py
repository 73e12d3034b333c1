"""Recipes: one Python function per recipe, returning a full SpiceConfig."""
from __future__ import annotations

from typing import Callable

from spice_megatron.config import SpiceConfig, apply_overrides
from spice_megatron.entry import UserError


class UnknownRecipe(UserError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def _registry() -> dict[str, Callable[[], SpiceConfig]]:
    from recipes import paper
    from recipes.tiny_cpu import tiny_cpu, tiny_cpu_deepseek

    return {"tiny_cpu": tiny_cpu, "tiny_cpu_deepseek": tiny_cpu_deepseek, "qwen3_4b": paper.qwen3_4b, "qwen3_8b": paper.qwen3_8b,
            "octothinker_3b": paper.octothinker_3b, "octothinker_8b": paper.octothinker_8b,
            "qwen3_14b": paper.qwen3_14b, "qwen3_32b": paper.qwen3_32b, "llama3_70b": paper.llama3_70b,
            "qwen3_4b_strong_challenger": paper.qwen3_4b_strong_challenger,
            "qwen3_8b_strong_challenger": paper.qwen3_8b_strong_challenger,
            "qwen3_30b_a3b": paper.qwen3_30b_a3b, "qwen3_30b_a3b_multinode": paper.qwen3_30b_a3b_multinode,
            "qwen3_235b_a22b": paper.qwen3_235b_a22b, "qwen3_235b_a22b_h200": paper.qwen3_235b_a22b_h200,
            "qwen3_4b_1node": paper.qwen3_4b_1node,
            "qwen3_8b_1node": paper.qwen3_8b_1node, "qwen3_30b_a3b_1node": paper.qwen3_30b_a3b_1node,
            "qwen2_5_7b": paper.qwen2_5_7b, "glm4_5_air": paper.glm4_5_air, "deepseek_v3": paper.deepseek_v3}


def get_recipe(name: str) -> SpiceConfig:
    recipes = _registry()
    if name not in recipes:
        raise UnknownRecipe(f"--recipe {name!r} is unknown; recipes: {', '.join(sorted(recipes))}")
    return recipes[name]()


def resolve_recipe(name: str, overrides: list[str], general_corpus: str = "") -> SpiceConfig:
    """A recipe with `spice`'s --general-corpus and key=value overrides applied."""
    cfg = get_recipe(name)
    if general_corpus:
        from recipes.paper import with_general_corpus

        cfg = with_general_corpus(cfg, general_corpus)
    return apply_overrides(cfg, overrides)


def recipe_names() -> list[str]:
    return sorted(_registry())


# Recipes meant for GPU clusters (the ones launchers and Slurm scripts take).
PAPER_RECIPES = ("qwen3_4b", "qwen3_8b", "octothinker_3b", "octothinker_8b")
LARGE_RECIPES = ("qwen3_14b", "qwen3_32b", "llama3_70b")
BASELINE_RECIPES = ("qwen3_4b_strong_challenger", "qwen3_8b_strong_challenger")  # fixed challenger, reasoner only
MOE_RECIPES = ("qwen3_30b_a3b", "qwen3_30b_a3b_multinode", "qwen3_235b_a22b", "qwen3_235b_a22b_h200")  # expert parallel, routing replay
COLOCATED_RECIPES = ("qwen3_4b_1node", "qwen3_8b_1node", "qwen3_30b_a3b_1node")  # one node, run.colocate
FAMILY_RECIPES = ("qwen2_5_7b", "glm4_5_air", "deepseek_v3")  # base models beyond the paper's families
CPU_RECIPES = ("tiny_cpu", "tiny_cpu_deepseek")  # one machine, no GPU
