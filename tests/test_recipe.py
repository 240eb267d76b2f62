import copy
import hashlib
import json
from pathlib import Path

import pytest
import yaml

from hexq.base.errors import HexqError
from hexq.config.fingerprint import calibration_hash
from hexq.config.model_check import validate_for_model
from hexq.config.recipe import (
    Experts,
    Recipe,
    WeightQuant,
    recipe_from_dict,
    recipe_to_dict,
)
from hexq.config.recipe_files import bundled_recipes, load_recipe

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ("haq-w8a8", "experts-mixed", "w4a16-g32", "rtn-w4a16")


def base() -> dict:
    """A complete recipe dict (the paper's setting) for tests to modify."""
    return recipe_to_dict(load_recipe("haq-w8a8"))


def fails(data: dict, *fragments: str) -> str:
    """recipe_from_dict(data) must fail with a one-line HexqError containing every fragment."""
    with pytest.raises(HexqError) as info:
        recipe_from_dict(data)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


def test_the_bundled_recipes_are_all_there():
    assert set(BUNDLED) <= set(bundled_recipes())


@pytest.mark.parametrize("name", bundled_recipes())
def test_every_bundled_recipe_loads_and_round_trips(name, tmp_path):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
    path = tmp_path / "copy.yaml"
    path.write_text(yaml.safe_dump(recipe_to_dict(recipe)))
    assert load_recipe(path) == recipe
    assert load_recipe(str(path)) == recipe
    assert calibration_hash(load_recipe(path)) == calibration_hash(recipe)


def test_bundled_recipes_say_what_the_issue_asks():
    haq = load_recipe("haq-w8a8")
    assert haq.smoothing.method == "haq" and haq.weights.method == "gptq"
    assert haq.weights.bits == 8 and haq.weights.group_size is None and not haq.weights.symmetric
    assert haq.activations.bits == 8 and haq.activations.dynamic and not haq.activations.symmetric
    assert haq.experts.mode == "uniform" and haq.expert_weights == haq.weights
    mixed = load_recipe("experts-mixed")
    assert mixed.experts.mode == "replicas" and mixed.experts.replica_bits == (1, 2, 3, 4, 8)
    assert not mixed.expert_activations.enabled and mixed.activations.bits == 8
    assert load_recipe("w4a16-g32").weights.spec().group_size == 32
    assert load_recipe("rtn-w4a16").weights.method == "rtn"


def test_the_gate_runs_the_bundled_recipe_as_shipped():
    """The perplexity gate's bundled setting (scripts/ppl_gate.py) is recipes/experts-mixed.yaml but for the
    calibration windows and the smoothing search's grid and sample, so a switch added to or changed in the bundled
    recipe is guarded by the gate only if it is made there too: this test fails until it is."""
    gate = recipe_to_dict(load_recipe(ROOT / "tests" / "baselines" / "recipes" / "gate-bundled.yaml"))
    bundled = recipe_to_dict(load_recipe("experts-mixed"))
    for recipe in (gate, bundled):
        del recipe["name"], recipe["calibration"]["num_samples"], recipe["calibration"]["seqlen"]
        del recipe["smoothing"]["grid_step"], recipe["smoothing"]["max_tokens"]
    assert gate == bundled


def test_defaults_are_the_paper_setting():
    recipe = recipe_from_dict({"name": "x"})
    assert recipe == Recipe(name="x")
    assert recipe_to_dict(recipe) | {"name": "haq-w8a8"} == base()


def test_unknown_top_level_key_names_key_and_allowed_ones():
    fails(base() | {"colour": "red"}, "unknown key 'colour' in recipe",
          "allowed: name, version, smoothing, weights, activations, experts, calibration")


@pytest.mark.parametrize(("section", "key"), [("smoothing", "grid_stp"), ("weights", "bitz"),
                                              ("calibration", "samples")])
def test_unknown_nested_key_names_section_key_and_allowed_ones(section, key):
    data = base()
    data[section][key] = 1
    message = fails(data, f"unknown key {key!r} in {section}", "allowed: ")
    assert all(name in message for name in data[section])


def test_unknown_key_two_levels_down():
    data = copy.deepcopy(base())
    data["experts"]["weights"] = {"bitz": 4}
    fails(data, "unknown key 'bitz' in experts.weights (did you mean 'bits'?)",
          "allowed: bits, group_size, symmetric, method, act_order, damp, block_size")


@pytest.mark.parametrize("bits", [0, 9])
@pytest.mark.parametrize("section", ["weights", "activations"])
def test_bits_outside_1_to_8_fail(section, bits):
    data = base()
    data[section]["bits"] = bits
    fails(data, f"{section}.bits must be in 1..8, got {bits}")


@pytest.mark.parametrize(("replica_bits", "fragment"), [
    ([], "experts.replica_bits is empty"),
    ([4, 2, 8], "experts.replica_bits must be in increasing order"),
    ([2, 4, 4, 8], "experts.replica_bits has duplicates"),
    ([0, 4], "experts.replica_bits must be in 1..8, got 0"),
    ([4, 9], "experts.replica_bits must be in 1..8, got 9"),
    ([1, 2, 8], "experts.propagate_bits must be one of replica_bits [1, 2, 8], got 4"),
])
def test_bad_replica_bits_fail(replica_bits, fragment):
    data = recipe_to_dict(load_recipe("experts-mixed"))
    data["experts"]["replica_bits"] = replica_bits
    fails(data, fragment)


@pytest.mark.parametrize(("section", "key", "value", "fragment"), [
    ("weights", "group_size", 0, "weights.group_size must be at least 1, got 0"),
    ("weights", "method", "awq", "weights.method must be one of gptq, rtn; got 'awq'"),
    ("weights", "act_order", "random", "weights.act_order must be one of none, max_activation, sum_of_squares"),
    ("weights", "damp", 0, "weights.damp must be in (0, 1], got 0.0"),
    ("smoothing", "grid_step", 0, "smoothing.grid_step must be in (0, 1], got 0.0"),
    ("smoothing", "grid_step", 1.5, "smoothing.grid_step must be in (0, 1], got 1.5"),
    ("smoothing", "groups", ["mlp"], "smoothing.groups must be one of attention, moe; got 'mlp'"),
    ("smoothing", "alpha", 0.8, "smoothing.alpha is used only with method 'smoothquant' (method is 'haq')"),
    ("calibration", "num_samples", 0, "calibration.num_samples must be at least 1, got 0"),
    ("experts", "replica_bits", [2, 4], "experts.replica_bits is used only with mode 'replicas'"),
])
def test_impossible_values_fail_naming_the_key(section, key, value, fragment):
    data = base()
    data[section][key] = value
    fails(data, fragment)


def test_replica_mode_rejects_expert_weight_bits():
    data = recipe_to_dict(load_recipe("experts-mixed"))
    data["experts"]["weights"]["bits"] = 4
    fails(data, "experts.weights.bits is not used in mode 'replicas'")


def test_settings_of_weight_only_activations_fail():
    data = base()
    data["activations"] = {"bits": None, "symmetric": True}
    fails(data, "activations.symmetric has no effect when bits is null")


@pytest.mark.parametrize(("section", "key", "value", "fragment"), [
    ("weights", "bits", "eight", "weights.bits must be an integer, got str 'eight'"),
    ("weights", "bits", True, "weights.bits must be an integer, got bool True"),
    ("weights", "group_size", "32", "weights.group_size must be an integer or null, got str '32'"),
    ("activations", "dynamic", "yes", "activations.dynamic must be true or false, got str 'yes'"),
    ("smoothing", "grid_step", "0.1", "smoothing.grid_step must be a number, got str '0.1'"),
    ("experts", "replica_bits", 4, "experts.replica_bits must be a list of integers, got int 4"),
])
def test_wrong_types_fail_naming_key_and_expected_type(section, key, value, fragment):
    data = base()
    data[section][key] = value
    fails(data, fragment)


def test_a_section_that_is_not_a_mapping_fails():
    fails(base() | {"weights": 8}, "weights must be a mapping, got int 8")
    data = base()
    data["experts"]["weights"] = [4]
    fails(data, "experts.weights must be a mapping or null, got list [4]")


def test_missing_name_and_wrong_version_fail():
    data = base()
    del data["name"]
    fails(data, "missing key 'name' in recipe")
    fails(base() | {"version": 3}, "version 3 is not supported")


def test_a_version_1_recipe_is_read_in_version_2_spelling_with_its_fingerprint():
    """Version 1 named the allocation's widths pack.bits: a calibration or artifact written then reads as the same
    recipe, and its calibration fingerprint is unchanged (pack is not hashed, nor is the spelling's version)."""
    current = base() | {"pack": base()["pack"] | {"widths": [2, 4]}}
    old = current | {"version": 1, "pack": {("bits" if key == "widths" else key): value
                                            for key, value in current["pack"].items()}}
    assert recipe_from_dict(old) == recipe_from_dict(current)
    assert recipe_from_dict(old).pack.widths == (2, 4)
    assert calibration_hash(recipe_from_dict(old)) == calibration_hash(recipe_from_dict(current))
    fails(current | {"pack": old["pack"]}, "bits")  # version 2 spells it widths


def test_integers_are_accepted_as_numbers_and_hash_the_same():
    data = base()
    data["weights"]["damp"] = 1
    as_int = recipe_from_dict(data)
    data["weights"]["damp"] = 1.0
    assert as_int.weights.damp == 1.0 and isinstance(as_int.weights.damp, float)
    assert calibration_hash(as_int) == calibration_hash(recipe_from_dict(data))


def test_group_size_not_dividing_a_width_fails_naming_the_width():
    recipe = load_recipe("w4a16-g32")
    validate_for_model(recipe, 192, {"moe_intermediate_size": 96, "intermediate_size": 384})
    with pytest.raises(HexqError, match="weights.group_size 32 does not divide hidden_size 80"):
        validate_for_model(recipe, 80, [96])
    with pytest.raises(HexqError, match="32 does not divide moe_intermediate_size 48"):
        validate_for_model(recipe, 192, {"moe_intermediate_size": 48})
    with pytest.raises(HexqError, match="experts.weights.group_size 32 does not divide intermediate size 40"):
        validate_for_model(load_recipe("experts-mixed"), 192, [96, 40])
    validate_for_model(load_recipe("haq-w8a8"), 81, [7])  # per-channel: any width


def test_missing_file_lists_bundled_recipes(tmp_path):
    names = ", ".join(bundled_recipes())
    with pytest.raises(HexqError, match="recipe file not found") as info:
        load_recipe(tmp_path / "nope.yaml")
    assert f"bundled recipes: {names}" in str(info.value)
    with pytest.raises(HexqError, match="unknown recipe 'haq-w4'") as info:
        load_recipe("haq-w4")
    assert f"bundled recipes: {names}" in str(info.value)


def test_file_errors_name_the_file_and_stay_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nweights:\n  bits: 8\n  bits: 4\n")
    with pytest.raises(HexqError, match="found duplicate key 'bits'") as info:
        load_recipe(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    path.write_text("name: x\nweights: [1, 2\n")
    with pytest.raises(HexqError, match="is not valid YAML at line") as info:
        load_recipe(path)
    assert "\n" not in str(info.value)
    path.write_text("name: x\nweights: {bits: 9}\n")
    with pytest.raises(HexqError, match="bad.yaml: weights.bits must be in 1..8, got 9"):
        load_recipe(path)
    path.write_text("")
    with pytest.raises(HexqError, match="recipe must be a mapping"):
        load_recipe(path)


def test_calibration_hash_is_stable_across_key_order():
    data = base()
    reordered = {key: (dict(reversed(list(value.items()))) if isinstance(value, dict) else value)
                 for key, value in reversed(list(data.items()))}
    assert list(reordered) != list(data)
    assert calibration_hash(recipe_from_dict(reordered)) == calibration_hash(recipe_from_dict(data))
    assert len(calibration_hash(recipe_from_dict(data))) == 64
    data["calibration"]["seed"] = 1
    assert calibration_hash(recipe_from_dict(data)) != calibration_hash(recipe_from_dict(reordered))


def test_smoothing_groups_are_stored_in_canonical_order():
    data = base()
    data["smoothing"]["groups"] = ["moe", "attention"]
    assert recipe_from_dict(data) == recipe_from_dict(base())


def test_dataclasses_validate_when_built_in_python_too():
    with pytest.raises(HexqError, match="bits must be in 1..8, got 9"):
        WeightQuant(bits=9)
    with pytest.raises(HexqError, match="replica_bits has duplicates"):
        Experts(mode="replicas", replica_bits=(4, 4))
    assert WeightQuant(bits=4, group_size=32).spec(2).bits == 2


def test_low_bit_switches_name_widths_the_recipe_quantizes():
    data = recipe_to_dict(load_recipe("experts-mixed"))
    data["experts"]["weights"]["fit_bits"] = [1, 2, 5]
    fails(data, "experts.weights.fit_bits lists [5], widths this recipe does not quantize")
    data = recipe_to_dict(load_recipe("experts-mixed"))
    data["experts"]["weights"]["refit_bits"] = [2, 6]
    fails(data, "experts.weights.refit_bits lists [6], widths this recipe does not quantize")
    data["experts"]["weights"]["refit_bits"] = [2]
    data["experts"]["weights"]["clip_bits"] = [2, 7]
    fails(data, "experts.weights.clip_bits lists [7], widths this recipe does not quantize")
    data["experts"]["weights"]["clip_bits"] = [2]
    data["head"]["refit_bits"] = [4]
    data["experts"]["weights"]["refit_bits"] = [1, 2]
    fails(data, "head.refit_bits lists [4]")
    data = recipe_to_dict(load_recipe("experts-mixed"))
    data["experts"]["round_bits"] = [2, 1]
    fails(data, "experts.round_bits must be increasing without duplicates")
    data["experts"]["round_bits"] = []
    data["experts"]["round_steps"] = 50
    fails(data, "experts.round_steps is used only with round_bits")
    data["experts"]["round_steps"] = 100
    data["experts"]["round_scope"] = "block"
    fails(data, "experts.round_scope is used only with round_bits")
    data["experts"]["round_bits"] = [1, 2]
    assert recipe_from_dict(data).experts.round_scope == "block"
    data["experts"]["round_tokens"] = 256
    fails(data, "experts.round_tokens is not used with round_scope block")
    data["experts"]["round_scope"] = "layer"
    fails(data, "experts.round_scope")
    data = base()  # attention at 8 bits: fitting its 4-bit grid would fit nothing
    data["weights"]["fit_bits"] = [4]
    fails(data, "weights.fit_bits lists [4]")
    data["weights"]["fit_bits"] = [8]
    assert recipe_from_dict(data).weights.fit_bits == (8,)
    data["weights"]["method"] = "rtn"
    for key in ("act_order", "damp", "block_size"):
        data["weights"].pop(key)
    fails(data, "weights.fit_bits is used only with method 'gptq'")
    data["weights"]["fit_bits"] = []
    data["weights"]["refit_bits"] = [8]
    fails(data, "weights.refit_bits is used only with method 'gptq'")
    data["weights"]["refit_bits"] = []
    data["weights"]["clip_bits"] = [8]
    fails(data, "weights.clip_bits is used only with method 'gptq'")


def manifest_hash(data: dict) -> str:
    """The calibration hash an older manifest holds for `data` (its recipe without pack and without the keys added
    since): sha256 of the canonical JSON, at version 1 (version 2 only renamed a key of pack, which is not hashed)."""
    data = data | {"version": 1}
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_calibrations_made_before_later_switches_keep_their_fingerprint():
    """A recipe with the later switches (the low-bit ones, the head section) at their defaults hashes as it did
    before they existed (the stored manifests of older calibrations have no such keys); turning one on changes the
    hash."""
    recipe = load_recipe("haq-w8a8")
    data = {key: value for key, value in recipe_to_dict(recipe).items() if key not in ("pack", "head")}
    for key in ("export_target", "round_bits", "round_steps", "round_tokens", "round_scope", "down_fit",
                "token_weights"):
        del data["experts"][key]
    del data["weights"]["fit_bits"], data["weights"]["one_bit"], data["weights"]["float_zero_bits"]
    del data["weights"]["refit_bits"], data["weights"]["clip_bits"]
    before = manifest_hash(data)
    assert calibration_hash(recipe) == before
    changed = recipe_to_dict(recipe)
    changed["weights"]["fit_bits"] = [8]
    assert calibration_hash(recipe_from_dict(changed)) != before
    changed = recipe_to_dict(recipe)
    changed["weights"]["one_bit"] = "spread"
    assert calibration_hash(recipe_from_dict(changed)) != before
    changed = recipe_to_dict(recipe)
    changed["weights"]["float_zero_bits"] = [8]
    assert calibration_hash(recipe_from_dict(changed)) != before
    changed = recipe_to_dict(recipe)
    changed["weights"]["refit_bits"] = [8]
    assert calibration_hash(recipe_from_dict(changed)) != before
    changed = recipe_to_dict(recipe)
    changed["weights"]["clip_bits"] = [8]
    assert calibration_hash(recipe_from_dict(changed)) != before
    assert calibration_hash(recipe_from_dict(recipe_to_dict(recipe) | {"head": {"bits": 8}})) != before
    mixed = recipe_to_dict(load_recipe("experts-mixed"))
    fitted = recipe_to_dict(load_recipe("experts-mixed"))
    fitted["experts"]["down_fit"] = "replica" if mixed["experts"]["down_fit"] == "full_precision" else "full_precision"
    assert calibration_hash(recipe_from_dict(fitted)) != calibration_hash(recipe_from_dict(mixed))
    weighted = recipe_to_dict(load_recipe("experts-mixed"))
    weighted["experts"]["token_weights"] = "equal" if mixed["experts"]["token_weights"] == "routing" else "routing"
    assert calibration_hash(recipe_from_dict(weighted)) != calibration_hash(recipe_from_dict(mixed))


def test_an_experts_and_head_recipe_from_before_the_later_switches_keeps_its_fingerprint():
    """The same for the switches of experts.weights and head: experts-mixed with every later switch at the value that
    reproduces older calibrations hashes as its manifest did before those keys existed; one turned on changes it."""
    old = recipe_to_dict(load_recipe("experts-mixed"))
    old["experts"].update(down_fit="full_precision", token_weights="equal")
    old["experts"]["weights"].update(one_bit="minmax", float_zero_bits=[], clip_bits=[], fit_bits=[], refit_bits=[])
    old["head"].update(float_zero_bits=[], refit_bits=[], clip_bits=[])
    recipe = recipe_from_dict(old)
    stored = {key: value for key, value in recipe_to_dict(recipe).items() if key != "pack"}
    for key in ("export_target", "round_bits", "round_steps", "round_tokens", "round_scope", "down_fit",
                "token_weights"):
        del stored["experts"][key]
    for key in ("fit_bits", "one_bit", "float_zero_bits", "refit_bits", "clip_bits"):
        del stored["weights"][key], stored["experts"]["weights"][key]
    for key in ("float_zero_bits", "refit_bits", "clip_bits"):
        del stored["head"][key]
    before = manifest_hash(stored)
    assert calibration_hash(recipe) == before
    for section, key in (("experts.weights", "clip_bits"), ("experts.weights", "refit_bits"), ("head", "clip_bits"),
                         ("head", "refit_bits"), ("head", "float_zero_bits")):
        changed = copy.deepcopy(old)
        place = changed["head"] if section == "head" else changed["experts"]["weights"]
        place[key] = [8] if section == "head" else [2]
        assert calibration_hash(recipe_from_dict(changed)) != before, (section, key)
