"""Recipe configuration: the pydantic schema and its loader. Imports no torch, ray or vllm."""

from zrl.config.load import RecipeError, apply_override, load_recipe, parse_recipe
from zrl.config.schema import Recipe, RLStage, SFTStage

__all__ = ["Recipe", "RLStage", "SFTStage", "RecipeError", "apply_override", "load_recipe", "parse_recipe"]
