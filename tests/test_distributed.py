"""hexq calibrate across ranks (torch.distributed, gloo on the CPU): the routed experts split across 2 and 3 ranks
give the single process's calibration, whatever the ranks' timing, and a killed rank ends the job with one line and
a folder that resumes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REFERENCE_MODELS, save_tiny_model, small_recipe
from safetensors import safe_open

from hexq.calib.ranks import expert_ranges

LAUNCH_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def recipe_file(folder: Path, name: str = "experts-mixed", **experts) -> Path:
    """A bundled recipe on 6 windows of 32 tokens (conftest.small_recipe), written where the CLI reads it."""
    from hexq.config.recipe import WeightQuant, recipe_to_dict

    recipe = small_recipe(name, weights=WeightQuant(group_size=16, symmetric=False), **experts)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_to_dict(recipe)))
    return path


def calibrate_command(model: Path, recipe: Path, out: Path) -> list[str]:
    return ["-m", "hexq_cli.main", "calibrate", str(model), "-r", str(recipe), "-o", str(out)]


def single_process(model: Path, recipe: Path, out: Path) -> str:
    """The same calibration in one process with one thread, as each rank computes (a BLAS with another thread count
    sums in another order)."""
    done = subprocess.run([sys.executable, *calibrate_command(model, recipe, out)], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def torchrun(world: int, model: Path, recipe: Path, out: Path) -> subprocess.CompletedProcess:
    # --log-dir: torchrun's agent otherwise leaves a folder of its own in the system's temporary folder per launch
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(free_port()), "--log-dir", str(out.with_name(out.name + "-torchrun")),
               *calibrate_command(model, recipe, out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def launch_ranks(world: int, model: Path, recipe: Path, out: Path, delays: dict[int, float] | None = None):
    """The ranks started by hand with the env:// variables (as a cluster scheduler would), rank r after delays[r]
    seconds."""
    port = free_port()
    processes = []
    started = time.monotonic()
    for rank in range(world):
        wait = (delays or {}).get(rank, 0) - (time.monotonic() - started)
        if wait > 0:
            time.sleep(wait)
        env = os.environ | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                            "HEXQ_DIST_TIMEOUT": "120"}
        processes.append(subprocess.Popen([sys.executable, *calibrate_command(model, recipe, out)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes


def layer_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("layer_*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                out[f"{path.name}:{key}"] = handle.get_tensor(key)
    return out


def compare(single: Path, split: Path) -> int:
    """The two calibrations tensor by tensor, bit for bit: the replica banks, loss tables, routing statistics and
    dense parts (the experts' combined outputs are summed in float64, exactly, so the split changes no bit); returns
    how many tensors were compared."""
    a, b = layer_tensors(single), layer_tensors(split)
    assert a.keys() == b.keys()
    differing = [key for key, left in a.items() if not torch.equal(left, b[key])]
    assert not differing, differing[:5]
    return len(a)


def perplexity_of(calibration: Path, tmp: Path) -> float:
    from hexq.calib.store import read_manifest
    from hexq.eval.run import evaluate_model
    from hexq.pack.stage import Budget, pack

    artifact = tmp / f"{calibration.name}.hexq"
    recipe = read_manifest(calibration).recipe
    if recipe.experts.mode == "replicas":
        pack(calibration, artifact, budget=Budget(avg_bits=2.5), overwrite=True)
    else:  # one width per expert (haq-w8a8: 8 bits)
        pack(calibration, artifact, replace(recipe.pack, widths=(8,), avg_bits=8.0), Budget(avg_bits=8), overwrite=True)
    (row,) = evaluate_model(artifact, ["austen"], 64, 4, 4, "cpu")
    return row.result.perplexity


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    """A tiny deepseek_v3: a dense first layer, then MoE layers with a shared expert."""
    return save_tiny_model(tmp_path_factory.mktemp("ds3"), "deepseek_v3", num_hidden_layers=3,
                           first_k_dense_replace=1)


@pytest.mark.parametrize(("name", "world", "recipe_name"), [("qwen3moe", 2, "experts-mixed"),
                                                            ("deepseek", 3, "experts-mixed"),
                                                            ("qwen3moe", 2, "haq-w8a8")])
def test_ranks_give_the_single_process_calibration(name, world, recipe_name, deepseek, tmp_path):
    """haq-w8a8 smooths the MoE group too: each rank scores its own experts in the routed search (hexq.calib.scales
    routed_search) and the summed errors choose the same exponents as one process."""
    model = deepseek if name == "deepseek" else REFERENCE_MODELS["qwen3moe"]
    recipe = recipe_file(tmp_path, recipe_name)
    single_process(model, recipe, tmp_path / "single")
    torchrun(world, model, recipe, tmp_path / "split")
    print(f"{name}, {world} ranks: {compare(tmp_path / 'single', tmp_path / 'split')} tensors equal")
    assert (tmp_path / "split" / "manifest.json").exists()
    single, split = perplexity_of(tmp_path / "single", tmp_path), perplexity_of(tmp_path / "split", tmp_path)
    print(f"{name}, {world} ranks: perplexity {split:.4f} vs {single:.4f} in one process")
    assert split == pytest.approx(single, rel=1e-4)
    timings = json.loads((tmp_path / "split" / "timings.json").read_text())
    for ranks in timings["ranks"].values():  # every rank's stages and peak RSS, per layer
        assert len(ranks) == world and all(r["stages"] and r["peak_rss_bytes"] > 0 for r in ranks)


def test_the_result_does_not_depend_on_the_ranks_timing(tmp_path):
    model, recipe = REFERENCE_MODELS["qwen3moe"], recipe_file(tmp_path)
    results = []
    for run, delays in enumerate(({}, {0: 0, 1: 3.0})):  # the second run starts rank 1 three seconds late
        out = tmp_path / f"run{run}"
        processes = launch_ranks(2, model, recipe, out, delays)
        for process in processes:
            _, err = process.communicate(timeout=LAUNCH_TIMEOUT)
            assert process.returncode == 0, err[-2000:]
        results.append(layer_tensors(out))
    first, second = results
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


def test_a_killed_rank_ends_the_job_in_one_line_and_the_rerun_resumes(tmp_path):
    from hexq.config.recipe import Calibration, recipe_to_dict
    from hexq.config.recipe_files import load_recipe

    model = REFERENCE_MODELS["qwen3moe"]
    recipe = recipe_file(tmp_path)
    slow = load_recipe(str(recipe))
    slow = replace(slow, calibration=Calibration(num_samples=48, seqlen=64, seed=0))  # layers long enough to hit
    recipe.write_text(yaml.safe_dump(recipe_to_dict(slow)))
    out = tmp_path / "cal"
    partial = tmp_path / ".cal.partial"
    processes = launch_ranks(2, model, recipe, out)
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not list(partial.glob(".layer_002.bank.safetensors.*.tmp")):  # layer 2's experts are being quantized
        assert time.monotonic() < deadline and processes[0].poll() is None, processes[0].communicate()[1][-2000:]
        time.sleep(0.005)
    processes[1].send_signal(signal.SIGKILL)
    _, err = processes[0].communicate(timeout=300)
    processes[1].wait()
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert processes[0].returncode == 1 and len(lines) == 1, err
    assert "rank 0 of 2 on" in lines[0] and "layer 2" in lines[0] and "Traceback" not in err
    assert not out.exists() and partial.exists()  # nothing published
    assert "resumed after layer 2" in " ".join(single_process(model, recipe, out).split())  # one resumes two's
    single_process(model, recipe, tmp_path / "whole")
    compare(tmp_path / "whole", out)


def test_expert_ranges_cover_every_expert_once_and_balance_the_cost():
    tokens = [100, 0, 0, 0, 400, 10, 10, 10]
    for world in (1, 2, 3, 8, 10):
        ranges = expert_ranges(tokens, world)
        assert len(ranges) == world and [e for r in ranges for e in r] == list(range(len(tokens)))
    for tokens in ([100, 0, 0, 0, 400, 10, 10, 10], [400, 0, 0, 0, 0, 0, 0, 0], [3, 90, 7, 0, 0, 12, 50, 1, 1]):
        costs = [1 + 0.5 * t / (sum(tokens) / len(tokens)) for t in tokens]
        for world in (2, 3):
            loads = [sum(costs[e] for e in r) for r in expert_ranges(tokens, world)]
            assert max(loads) <= sum(costs) / world + max(costs) / 2 + 1e-9  # each cut within half an expert
        # two ranks: the best contiguous split there is (the cut nearest half the cost)
        best = min(max(sum(costs[:cut]), sum(costs[cut:])) for cut in range(1, len(tokens)))
        assert max(sum(costs[e] for e in r) for r in expert_ranges(tokens, 2)) == pytest.approx(best)
    assert expert_ranges([5] * 4, 2) == [range(0, 2), range(2, 4)]
    # more ranks than experts: one expert each for the first ranks, none for the rest
    assert expert_ranges([1, 2, 3], 5) == [range(0, 1), range(1, 2), range(2, 3), range(3, 3), range(3, 3)]
