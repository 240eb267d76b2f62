"""A regular (non-editable) install: the wheel holds every subpackage, the bundled recipes and calibration text, and
an installed hexq finds them from any working directory."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hexq.packed import cpu
from tests.conftest import TOKENIZER_DIR, build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "hexq", "cli", "recipes", "calib_data")

# Run by the installed package, from outside the checkout: where hexq was imported from and what it bundles.
PROBE = """
import json, hexq
from hexq.base.data import TRAIN_CORPORA, calibration_text
from hexq.config.recipe_files import bundled_recipes, load_recipe
print(json.dumps({"hexq": hexq.__file__, "recipes": bundled_recipes(), "mixed": load_recipe("experts-mixed").name,
                  "bundled": len(calibration_text("bundled")),
                  "slices": {name: len(calibration_text(name)) for name in TRAIN_CORPORA}}))
"""


def run(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(wheel, folder the wheel was installed into with pip --target), built from a copy of the sources."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(root / "wheels"), str(source)], cwd=root)
    (wheel,) = (root / "wheels").glob("hexq-*.whl")
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "-q", "--target",
         str(root / "site"), str(wheel)], cwd=root)
    return wheel, root / "site"


def outside_env(site: Path) -> dict:
    """The environment of a user of the installed package: the install folder on the path, not the checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site),
                                                                        "HF_HUB_OFFLINE": "1"}


def test_wheel_holds_every_subpackage_module_and_bundled_file(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hexq").rglob("__init__.py"))
    assert "hexq.algos" in packages and "hexq.runtime" in packages
    missing = [pkg for pkg in packages if f"{pkg.replace('.', '/')}/__init__.py" not in names]
    assert not missing, f"subpackages missing from the wheel (add them to pyproject's packages list): {missing}"
    modules = [str(p.relative_to(ROOT)) for p in (ROOT / "hexq").rglob("*.py") if "__pycache__" not in p.parts]
    modules += [f"hexq_cli/{p.name}" for p in (ROOT / "cli").glob("*.py")]
    assert not [m for m in modules if m.replace(os.sep, "/") not in names]
    recipes = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
    slices = sorted(p.name for p in (ROOT / "calib_data").glob("*.txt"))
    assert "experts-mixed.yaml" in recipes and len(slices) == 3
    assert {f"hexq/recipes/{name}" for name in recipes} <= names
    assert {f"hexq/calib_data/{name}" for name in slices} <= names
    # the CPU kernels are compiled from these at first use: without one, every kernel path is gone
    kernel_sources = {str(p.relative_to(ROOT)) for pattern in ("*.c", "*.h") for p in (ROOT / "hexq").rglob(pattern)}
    assert {str(p.relative_to(ROOT)) for p in (*cpu.SOURCES, *cpu.HEADERS)} <= kernel_sources
    assert kernel_sources <= names


def test_installed_package_finds_recipes_and_calibration_text_outside_the_checkout(installed, tmp_path):
    _, site = installed
    found = json.loads(run([sys.executable, "-c", PROBE], cwd=tmp_path, env=outside_env(site)).stdout)
    assert Path(found["hexq"]).is_relative_to(site)  # the installed copy, not the checkout
    assert found["recipes"] == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert found["mixed"] == "experts-mixed"
    for name, length in found["slices"].items():
        assert length == len((ROOT / "calib_data" / f"{name}.txt").read_text(encoding="utf-8"))
    assert found["bundled"] == sum(found["slices"].values()) + 2 * (len(found["slices"]) - 1)  # joined by \n\n


@pytest.mark.slow  # about 30 s, most of it the calibration; the probe above covers the lookups by default
def test_installed_cli_calibrates_with_a_bundled_recipe_and_bundled_data(installed, tmp_path):
    _, site = installed
    from transformers import AutoTokenizer

    model = tmp_path / "tiny"
    # experts-mixed quantizes experts in groups of 32 input columns: the expert width must be a multiple of 32
    build_tiny_model("qwen3_moe", moe_intermediate_size=32).save_pretrained(model)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(model)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run([sys.executable, "-m", "hexq_cli.main", "calibrate", str(model), "--recipe", "experts-mixed",
                  "--data", "bundled", "--samples", "2", "--seqlen", "32", "--out", "cal"],
                 cwd=elsewhere, env=outside_env(site) | {"COLUMNS": "200"})
    assert "calibrated 2 layers" in result.stdout, result.stdout
    assert (elsewhere / "cal" / "manifest.json").is_file()
