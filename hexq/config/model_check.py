"""A recipe against the model it calibrates: the checks that need the model's shapes (hexq.calib.pipeline runs them
before the first layer is read)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hexq.config.recipe import Recipe, RecipeError


def validate_for_model(recipe: Recipe, hidden_size: int,
                       intermediate_sizes: Mapping[str, int] | Iterable[int]) -> None:
    """Fail unless every group size divides every quantized input width of the model: hidden_size (q/k/v, gate/up of
    experts and shared expert) and the intermediate sizes (down projections), given as {config attribute: size} for
    clearer messages, or as plain sizes; other input widths (o_proj's num_heads * head_dim when it differs from
    hidden_size) the same way. Both the top-level and the experts' group size are checked against every width
    (conservative: the caller need not say which is which)."""
    named = (list(intermediate_sizes.items()) if isinstance(intermediate_sizes, Mapping)
             else [("intermediate size", size) for size in intermediate_sizes])
    widths = [("hidden_size", hidden_size), *named]
    listed = ", ".join(f"{name} {size}" for name, size in widths)
    for key, quant in (("weights", recipe.weights), ("experts.weights", recipe.expert_weights)):
        group = quant.group_size
        for name, size in widths:
            if group is not None and size % group:
                raise RecipeError(f"{key}.group_size", f"{group} does not divide {name} {size}; choose a group size "
                                                       f"dividing every input width ({listed}) or null (per-channel)")
    head_group = recipe.head.group_size if recipe.head is not None else None
    if head_group is not None and hidden_size % head_group:
        raise RecipeError("head.group_size", f"{head_group} does not divide hidden_size {hidden_size} (the head's "
                                             "input width); choose a divisor or null (per-channel)")
