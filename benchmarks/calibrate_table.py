"""Perplexity table for `hexq calibrate`: hexq's methods against llmcompressor's oneshot, one run.

    python benchmarks/calibrate_table.py                       # both reference models, all settings
    python benchmarks/calibrate_table.py --models qwen3moe --settings w8a8-dyn w4a4 --no-peer

For each reference model (and its outlier-injected variant: a function-preserving transform that multiplies 4
channels of every norm by 50 and divides the matching input columns of its readers by 50), every setting and
every method is calibrated on the same windows of the bundled calibration text (fixed seed) and evaluated on
the same first N windows (length 256) of WikiText-2 and of the held-out austen text.

Methods with quantized activations: RTN; SmoothQuant(0.5)+RTN; GPTQ only; HAQ (search + GPTQ); llmcompressor
SmoothQuantModifier(0.5)+GPTQModifier. Weight-only settings: hexq GPTQ vs llmcompressor GPTQModifier.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hexq.base.data import calibration_windows, eval_text, tokenize
from hexq.calib.pipeline import calibrate
from hexq.config.recipe import ActivationQuant, Calibration, Experts, Recipe, Smoothing, WeightQuant
from hexq.eval.perplexity import perplexity
from hexq.eval.run import evaluate_model

from outliers import inject_outliers
from provenance import start_run, write_results
from reference import load_model

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
EVAL_DATA = ("wikitext2", "austen")
SEQLEN = 256


@dataclass(frozen=True)
class Setting:
    weight_bits: int
    group_size: int | None
    weight_symmetric: bool
    act_bits: int | None
    act_dynamic: bool = True


SETTINGS = {
    "w8a8-dyn": Setting(8, None, False, 8),
    "w8a8-static": Setting(8, None, False, 8, act_dynamic=False),
    "w6a6": Setting(6, None, False, 6),
    "w4a8": Setting(4, None, False, 8),
    "w4a4": Setting(4, None, False, 4),
    "w4a16-g32": Setting(4, 32, True, None),
    "w4a16": Setting(4, None, True, None),
    "w3a16": Setting(3, None, True, None),
    "w2a16": Setting(2, None, True, None),
}
# haq scores each routed expert on its routed tokens (smoothing.moe_objective "routed"); haq-all on every token
ACTIVATION_METHODS = ("rtn", "sq+rtn", "gptq", "haq", "haq-all")
WEIGHT_ONLY_METHODS = ("rtn", "gptq", "gptq-act")  # gptq-act: columns in decreasing diag(H) order (GPTQ's actorder)


def make_recipe(name: str, setting: Setting, method: str, samples: int) -> Recipe:
    weights = WeightQuant(bits=setting.weight_bits, group_size=setting.group_size,
                          symmetric=setting.weight_symmetric, method="rtn" if method.endswith("rtn") else "gptq",
                          act_order="sum_of_squares" if method == "gptq-act" else "none")
    activations = (ActivationQuant(bits=None) if setting.act_bits is None
                   else ActivationQuant(bits=setting.act_bits, dynamic=setting.act_dynamic))
    smoothing = {"sq+rtn": Smoothing(method="smoothquant", alpha=0.5), "haq": Smoothing(method="haq"),
                 "haq-all": Smoothing(method="haq", moe_objective="all")}.get(method, Smoothing(method="none"))
    return Recipe(name=f"{name}-{method}", smoothing=smoothing, weights=weights, activations=activations,
                  experts=Experts(mode="uniform"), calibration=Calibration(num_samples=samples, seqlen=SEQLEN))


def eval_streams(tokenizer) -> dict[str, torch.Tensor]:
    return {name: tokenize(tokenizer, eval_text(name)) for name in EVAL_DATA}


def ppl(model, streams, windows: int) -> dict[str, float]:
    return {name: round(perplexity(model, ids, SEQLEN, windows, batch_size=8).perplexity, 4)
            for name, ids in streams.items()}


def outlier_variant(folder: Path, work: Path) -> Path:
    """The model with injected outlier channels, saved in fp32 so the transform stays function-preserving."""
    target = work / f"{folder.name}-outliers"
    if not (target / "config.json").exists():
        model, tokenizer, adapter = load_model(folder)
        inject_outliers(model, adapter, channels_per_norm=4, factor=50.0, seed=0)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target


def run(models: list[str], settings: list[str], samples: int, windows: int, outlier_settings: list[str],
        peer: bool, out_json: Path, only_methods: list[str] | None = None, record: dict | None = None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="hexq-bench-"))
    results = {"protocol": {"seqlen": SEQLEN, "eval_windows": windows, "eval_data": list(EVAL_DATA),
                            "calibration": {"source": "bundled", "num_samples": samples, "seqlen": SEQLEN,
                                            "seed": 0}},
               "rows": []}
    try:
        for model_name in models:
            variants = [(model_name, MODELS[model_name], settings)]
            if outlier_settings:
                variants.append((f"{model_name}+outliers", outlier_variant(MODELS[model_name], work), outlier_settings))
            for label, folder, variant_settings in variants:
                model, tokenizer, _ = load_model(folder)
                streams = eval_streams(tokenizer)
                calib_ids = calibration_windows(tokenizer, "bundled", samples, SEQLEN, seed=0).ids
                fp = ppl(model, streams, windows)
                results["rows"].append({"model": label, "setting": "fp", "method": "fp", **fp})
                print(json.dumps(results["rows"][-1]), flush=True)
                for setting_name in variant_settings:
                    setting = SETTINGS[setting_name]
                    methods = ACTIVATION_METHODS if setting.act_bits is not None else WEIGHT_ONLY_METHODS
                    for method in (m for m in methods if only_methods is None or m in only_methods):
                        recipe = make_recipe(setting_name, setting, method, samples)
                        out = work / f"{label}-{recipe.name}"
                        started = time.time()
                        calibrate(folder, recipe, "bundled", out)
                        seconds = time.time() - started
                        rows = evaluate_model(out, list(EVAL_DATA), SEQLEN, windows, 8, "cpu")
                        row = {"model": label, "setting": setting_name, "method": f"hexq {method}",
                               **{r.data: round(r.result.perplexity, 4) for r in rows},
                               "calib_seconds": round(seconds, 1)}
                        results["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        shutil.rmtree(out)
                    if peer:
                        from llmcompressor_peer import PEER_SCHEMES, run_peer

                        started = time.time()
                        peer_model = run_peer(folder, PEER_SCHEMES[setting_name], calib_ids)
                        seconds = time.time() - started
                        row = {"model": label, "setting": setting_name, "method": "llmcompressor",
                               **ppl(peer_model, streams, windows), "calib_seconds": round(seconds, 1)}
                        results["rows"].append(row)
                        print(json.dumps(row), flush=True)
                    if record is not None:  # after every setting: a partial run keeps its rows
                        write_results(out_json, results, record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def markdown(results: dict) -> str:
    lines = ["| model | setting | method | " + " | ".join(EVAL_DATA) + " |", "|---|---|---|" + "---|" * len(EVAL_DATA)]
    for row in results["rows"]:
        lines.append(f"| {row['model']} | {row['setting']} | {row['method']} | "
                     + " | ".join(f"{row[d]:.3f}" for d in EVAL_DATA) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens")
    parser.add_argument("--windows", type=int, default=100, help="evaluation windows per text")
    parser.add_argument("--outlier-settings", nargs="*", default=["w8a8-dyn", "w6a6", "w4a8", "w4a4"],
                        choices=list(SETTINGS), help="settings also run on the outlier-injected variant (none: skip)")
    parser.add_argument("--no-peer", action="store_true", help="skip llmcompressor")
    parser.add_argument("--methods", nargs="+", help="only these hexq methods (default: all of the setting's)")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibrate.json")
    parser.add_argument("--render", type=Path, nargs="+", help="only print the markdown table of result files")
    args = parser.parse_args()
    if args.render:
        for path in args.render:
            print(markdown(json.loads(path.read_text())))
        return
    record = start_run(args)
    results = run(args.models, args.settings, args.samples, args.windows, args.outlier_settings, not args.no_peer,
                  args.out, args.methods, record)
    write_results(args.out, results, record, complete=True)
    print(markdown(results))


if __name__ == "__main__":
    main()
