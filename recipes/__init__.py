"""Recipes: one Python function per recipe, returning a full SpiceConfig."""
from __future__ import annotations

from typing import Callable

from spice_megatron.config import SpiceConfig


def _registry() -> dict[str, Callable[[], SpiceConfig]]:
    from recipes.tiny_cpu import tiny_cpu

    return {"tiny_cpu": tiny_cpu}


def get_recipe(name: str) -> SpiceConfig:
    recipes = _registry()
    if name not in recipes:
        raise KeyError(f"recipe {name!r} is unknown; recipes: {', '.join(sorted(recipes))}")
    return recipes[name]()


def recipe_names() -> list[str]:
    return sorted(_registry())
