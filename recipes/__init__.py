"""Recipes: one Python function per recipe, returning a full SpiceConfig, registered with its group
by `@recipe(GROUP)` (recipes/registry.py); this package holds configs only."""
from __future__ import annotations

from recipes import paper, tiny_cpu  # noqa: F401 - each registers its recipes
from recipes.registry import BASELINE, COLOCATED, CPU, FAMILY, LARGE, MOE, PAPER, RECIPES, in_group
from spice_megatron.config import SpiceConfig, apply_overrides
from spice_megatron.entry import UserError


class UnknownRecipe(UserError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def get_recipe(name: str) -> SpiceConfig:
    if name not in RECIPES:
        from spice_megatron.entry import did_you_mean

        hint = did_you_mean(name, RECIPES)
        raise UnknownRecipe(f"--recipe {name!r} is unknown" + (hint or f"; recipes: {', '.join(sorted(RECIPES))}"))
    return RECIPES[name]()


def resolve_recipe(name: str, overrides: list[str], general_corpus: str = "") -> SpiceConfig:
    """A recipe with `spice`'s --general-corpus and key=value overrides applied."""
    cfg = get_recipe(name)
    if general_corpus:
        from recipes.paper import with_general_corpus

        cfg = with_general_corpus(cfg, general_corpus)
    return apply_overrides(cfg, overrides)


def recipe_names() -> list[str]:
    return sorted(RECIPES)


DEFAULT_RECIPE = "tiny_cpu"  # what every command takes without --recipe: the CPU demo
# each group in the order its recipes are defined (the README's and docs' tables)
PAPER_RECIPES = in_group(PAPER)
LARGE_RECIPES = in_group(LARGE)
BASELINE_RECIPES = in_group(BASELINE)  # fixed challenger, reasoner only
MOE_RECIPES = in_group(MOE)  # expert parallel, routing replay
COLOCATED_RECIPES = in_group(COLOCATED)  # one node, run.colocate
FAMILY_RECIPES = in_group(FAMILY)  # base models beyond the paper's families
CPU_RECIPES = in_group(CPU)  # one machine, no GPU
