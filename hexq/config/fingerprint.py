"""A calibration's fingerprint: which recipe settings make its numbers, hashed so that a resumed or reused
calibration is known to come from the same recipe (hexq.calib.pipeline, hexq.calib.store)."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from hexq.config.recipe import Recipe, recipe_to_dict


def _hash_dict(data: dict[str, Any]) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# Settings added after calibrations were first written, with the value that reproduces what came before: left out of
# the calibration hash at that value, so older calibrations keep their fingerprint.
LATER_SETTINGS = {("experts", "export_target"): None, ("weights", "fit_bits"): [],
                   ("experts", "weights", "fit_bits"): [], ("experts", "round_bits"): [],
                   ("experts", "round_steps"): 100, ("experts", "round_tokens"): 512,
                   ("experts", "round_scope"): "expert", ("weights", "one_bit"): "minmax",
                   ("experts", "weights", "one_bit"): "minmax", ("head",): None,
                   ("weights", "float_zero_bits"): [], ("experts", "weights", "float_zero_bits"): [],
                   ("head", "float_zero_bits"): [], ("experts", "down_fit"): "full_precision",
                   ("weights", "refit_bits"): [], ("experts", "weights", "refit_bits"): [], ("head", "refit_bits"): [],
                   ("experts", "token_weights"): "equal", ("weights", "clip_bits"): [],
                   ("experts", "weights", "clip_bits"): [], ("head", "clip_bits"): []}


def calibration_hash(recipe: Recipe) -> str:
    """sha256 of the recipe's canonical JSON (sorted keys, no whitespace) without the pack section: changing how a
    calibration is packed does not invalidate it. Settings added later (LATER_SETTINGS) are left out at their
    earlier behaviour, so calibrations made before they existed keep their fingerprint."""
    data = {key: value for key, value in recipe_to_dict(recipe).items() if key != "pack"}
    data["version"] = 1  # version 2 renamed a key of pack, which is not hashed: calibrations keep their fingerprint
    for *path, key in LATER_SETTINGS:
        section = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, path, data)
        if isinstance(section, dict) and section.get(key) == LATER_SETTINGS[(*path, key)]:
            del section[key]
    return _hash_dict(data)
