import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hexq.report.numbers import calibrate_points, heldout_hit_rates, pack_quality_points
from hexq.report.page import write_report
from hexq_cli.main import app

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = ("hotness.png", "loss_tables.png", "allocation.png", "hit_rates.png", "frontier.png")
TEXTS = ("wikitext2", "austen", "pydocs", "foldoc")


def ppl_row(factor: float, texts=TEXTS) -> dict:
    return {text: 50.0 * factor * (1 + i / 10) for i, text in enumerate(texts)}


def write_results(folder: Path, layers: int = 2, experts: int = 8) -> Path:
    """Benchmark result files for the tiny Qwen3-MoE, in the structure the benchmark scripts write."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {"fp": ppl_row(1.0), "uniform-2": ppl_row(1.3), "uniform-3": ppl_row(1.05), "uniform-4": ppl_row(1.01),
            "mixed-2.5": ppl_row(1.08), "mixed-3.0": ppl_row(1.03), "blind-2.5": ppl_row(1.15),
            "blind-3.0": ppl_row(1.06)}
    rows["blind-2.5"]["seeds"] = {"0": ppl_row(1.15)}
    allocation = {"2.5": [[2, 3] * (experts // 2)] * layers, "3.0": [[3] * experts] * layers}
    (folder / "pack_quality.json").write_text(json.dumps(
        {"windows": 40, "seqlen": 256, "models": {"qwen3moe": {"rows": rows, "allocation": allocation}}}))
    calibrate = [{"model": "qwen3moe", "setting": "fp", "method": "fp", **ppl_row(1.0, TEXTS[:2])}]
    for setting, factor in (("w4a16", 1.01), ("w3a16", 1.05), ("w2a16", 1.2), ("w4a16-g32", 1.0), ("w4a4", 1.1)):
        for method in ("hexq rtn", "hexq gptq", "llmcompressor"):
            calibrate.append({"model": "qwen3moe", "setting": setting, "method": method,
                              **ppl_row(factor, TEXTS[:2]), "calib_seconds": 1.0})
    calibrate.append({"model": "qwen3moe+outliers", "setting": "w4a16", "method": "hexq gptq", **ppl_row(9)})
    (folder / "calibrate.json").write_text(json.dumps({"rows": calibrate}))
    placement = [{"model": "qwen3moe", "K": round(fraction * experts), "fraction": fraction, "scheme": scheme,
                  "trace": trace, "per_layer": [0.4 + fraction / 2] * layers}
                 for fraction in (0.25, 0.5) for scheme in ("1", "2", "3", "2g") for trace in ("heldout", "calib")]
    (folder / "placement.json").write_text(json.dumps(
        {"models": {"qwen3moe": {"layers": layers, "experts": experts, "top_k": 2}}, "rows": placement}))
    return folder


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header, after checking the signature and the IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def report(mixed_artifact, tmp_path_factory) -> Path:
    """index.html of the tiny mixed artifact, with every benchmark result file present."""
    root = tmp_path_factory.mktemp("report")
    return write_report(mixed_artifact, root / "out", write_results(root / "results"))


def test_every_plot_is_a_png_and_on_the_page(report, mixed_artifact):
    page = report.read_text()
    for name in PLOTS:
        width, height = png_size(report.parent / name)
        assert width > 100 and height > 100
        assert f'<img src="{name}" alt="' in page
    assert "qwen3_moe: 2 layers x 8 experts" in page
    files = len(json.loads((mixed_artifact / "manifest.json").read_text())["files"])
    assert f"all {files} files match the manifest" in page
    assert "not found" not in page
    assert not list(report.parent.glob(".*.tmp"))  # no temporary files left behind


def test_tables_hold_the_numbers_behind_the_plots(report):
    page = report.read_text()
    assert "2 (25%)" in page and "4 (50%)" in page  # K = 25% and 50% of 8 experts
    for scheme in ("1 paths", "2 frequency", "3 two_stage"):
        assert scheme in page
    assert "held-out" in page and "calibration" in page
    assert "hexq mixed: mixed-2.5" in page and "llmcompressor gptq, all linears: w2a16 llmcompressor" in page
    assert "w4a16-g32" not in page and "w4a4" not in page and "hexq rtn" not in page


def test_same_inputs_give_the_same_bytes_through_the_cli(report, mixed_artifact, tmp_path):
    out = tmp_path / "again"
    result = CliRunner().invoke(app, ["report", str(mixed_artifact), "-o", str(out), "--results",
                                      str(report.parent.parent / "results")])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(out / "index.html")
    for name in (*PLOTS, "index.html"):
        assert (out / name).read_bytes() == (report.parent / name).read_bytes(), name


def test_missing_results_become_notes_naming_the_command(mixed_artifact, tmp_path):
    index = write_report(mixed_artifact, tmp_path / "out", tmp_path / "no-results")
    page = index.read_text()
    assert "pack_quality.json not found; `python benchmarks/pack_quality.py` writes it" in page
    assert "calibrate.json not found; `python benchmarks/calibrate_table.py` writes it" in page
    assert "placement.json not found; `python benchmarks/placement.py` writes it" in page
    assert "frontier.png" not in page and not (tmp_path / "out" / "frontier.png").exists()
    for name in PLOTS[:4]:  # the artifact alone is enough for these
        assert f'<img src="{name}"' in page


def test_result_files_of_another_shape_or_model_are_not_mixed_in(tmp_path):
    results = write_results(tmp_path, layers=4, experts=32)
    placement = json.loads((results / "placement.json").read_text())
    rows, note = heldout_hit_rates(placement, "qwen3moe", 2, 8, results / "placement.json")
    assert rows == [] and "4 layers x 32 experts" in note
    rows, note = heldout_hit_rates(placement, "qwen3moe", 4, 32, results / "placement.json")
    assert note is None and {row.scheme for row in rows} == {"1", "2", "3"}  # not the global scheme 2g
    points, note = pack_quality_points(json.loads((results / "pack_quality.json").read_text()), "mixtral", results)
    assert points == [] and "no rows for mixtral" in note


def test_frontier_points_use_the_reached_average_and_weight_only_rows(tmp_path):
    results = write_results(tmp_path)
    pack_quality = json.loads((results / "pack_quality.json").read_text())
    pack_quality["models"]["qwen3moe"]["allocation"]["2.5"] = [[2, 2, 3, 3, 2, 2, 3, 4]] * 2  # 2.625 bits
    points, note = pack_quality_points(pack_quality, "qwen3moe", results / "pack_quality.json")
    assert note is None
    by_label = {p.label: p for p in points}
    assert by_label["mixed-2.5"].bits == 2.625 and by_label["blind-2.5"].bits == 2.625
    assert by_label["uniform-3"].bits == 3.0
    assert "seeds" not in by_label["blind-2.5"].perplexity
    points, _ = calibrate_points(json.loads((results / "calibrate.json").read_text()), "qwen3moe", results)
    assert sorted((p.series, p.bits) for p in points) == sorted(
        (series, bits) for series in ("hexq gptq, all linears", "llmcompressor gptq, all linears")
        for bits in (2.0, 3.0, 4.0))


# ------------------------------------------------------------------------------------------ the output folder


def report_cli(*args: str):
    return CliRunner().invoke(app, ["report", *map(str, args)])


@pytest.fixture
def own_artifact(mixed_artifact, tmp_path) -> Path:
    """A copy of the tiny artifact in its own folder, so that a wrongly accepted destination harms only the copy."""
    return Path(shutil.copytree(mixed_artifact, tmp_path / "inputs" / "model.hexq"))


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_cli_refuses_a_folder_hexq_did_not_write(own_artifact, tmp_path, force):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = report_cli(own_artifact, "-o", out, "--results", tmp_path / "none", *force)
    assert result.exit_code == 1 and "was not written by hexq" in result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_cli_replaces_its_own_report_only_with_force(own_artifact, tmp_path):
    out = tmp_path / "report"
    assert report_cli(own_artifact, "-o", out, "--results", tmp_path / "none").exit_code == 0
    again = report_cli(own_artifact, "-o", out, "--results", tmp_path / "none")
    assert again.exit_code == 1 and "pass --force to replace it" in again.output
    (out / "stale.png").write_bytes(b"from an older report")
    forced = report_cli(own_artifact, "-o", out, "--results", tmp_path / "none", "--force")
    assert forced.exit_code == 0, forced.output
    assert not (out / "stale.png").exists() and (out / "index.html").is_file()


def test_cli_never_writes_over_or_around_an_input(own_artifact, tmp_path):
    results = write_results(tmp_path / "results")
    before = sorted(p.name for p in own_artifact.iterdir())
    cases = {own_artifact: "is the input", own_artifact.parent: "contains the input",
             own_artifact / "report": "is inside the input", results: "is the input"}
    for out, message in cases.items():
        result = report_cli(own_artifact, "-o", out, "--results", results, "--force")
        assert result.exit_code == 1 and message in result.output, (out, result.output)
    assert sorted(p.name for p in own_artifact.iterdir()) == before
    assert {p.name for p in results.iterdir()} == {"pack_quality.json", "calibrate.json", "placement.json"}


# ------------------------------------------------------------------------------------------ in a browser


def missing_browser(reason: str) -> None:
    """Skip on a developer's machine; fail in CI (CI=true), where .ci/run installs the browser."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason}; CI must run the browser test")
    pytest.skip(reason)


def chromium_driver(profile: Path):
    """Headless Chromium through selenium and the system chromedriver; skips (fails in CI) when one is missing."""
    try:
        from selenium import webdriver
    except ImportError:
        missing_browser("selenium not installed (pip install selenium)")
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        missing_browser(f"chromium not found: browser {browser}, chromedriver {driver} "
                        "(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}"):  # --no-sandbox: CI runs as root
        options.add_argument(flag)
    # An explicit driver path: selenium must not try to download one.
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


def test_every_image_loads_in_headless_chromium(report, tmp_path):
    driver = chromium_driver(tmp_path / "profile")
    try:
        driver.set_page_load_timeout(60)
        driver.get(report.resolve().as_uri())
        images = driver.execute_script(
            "return Array.from(document.images, i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
    finally:
        driver.quit()
    assert sorted(src for src, _, _ in images) == sorted(PLOTS)
    for src, complete, width in images:
        assert complete and width > 0, f"{src} did not load"
