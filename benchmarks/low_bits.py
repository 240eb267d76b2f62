"""Below 3 bits: hexq's replicas and allocator piece by piece, and the peers at W2A16 / W3A16 group 32.

    python benchmarks/low_bits.py                                    # both reference models, every row (hours)
    python benchmarks/low_bits.py --models qwen3moe --samples 16 --windows 8 --settings main fit   # a quick check

Every row is evaluated on the same first N windows (length 256) of the held-out austen, pydocs and foldoc text
(never calibrated on), and every calibration (hexq's and the peers') uses the same windows of the bundled text
(--samples windows of 256 tokens, drawn with --seed, 0 by default).

hexq rows: the model calibrated with recipe experts-mixed (HAQ W8A8 attention, a replica bank of routed experts at
1, 2, 3, 4, 8 bits, groups of 32, asymmetric) with the bank made as each SETTINGS entry says, then evaluated with
every expert at 2 and at 3 bits (uniform) and with the allocation `hexq pack` makes at 1.5, 2.0, 2.5 and 3.0 average
bits, by each ALLOCATORS entry (the last setting gets every allocator, the others "main" and the recommended one;
the bundled experts-mixed recipe is setting "act+spread+float+down+routed" with allocator "model+0"). The pieces:
`fit` (group grids fitted to the Hessian-weighted error, hexq.algos.clipping), `act` (columns in decreasing
Hessian-diagonal order, static groups: GPTQ's act_order), `round` (1- and 2-bit rounding optimised on routed tokens,
hexq.algos.rounding), `spread` (1-bit levels at mean -+ 1.75 mean absolute deviations instead of min and max,
experts.weights.one_bit), `float` (2-bit grids spanning each group's min and max with a float zero point instead of
widened to include 0 with an integer one, experts.weights.float_zero_bits; `float23` at 3 bits too), `block` (the
same widths optimised against the full-precision model's output after each layer, experts.round_scope block),
`down` (each width's down projection fitted to its own gate_up replica's intermediate, experts.down_fit replica),
`refit` (every width's group grids refitted to GPTQ's codes under its Hessian, experts.weights.refit_bits; `refit12`
at 1 and 2 bits only), `damp0.05` / `damp0.1` (GPTQ's damping of the experts' Hessians, 0.01 in the recipe),
`routed` (each routed token weighted by its squared routing weight in its expert's Hessians, down fit and loss table,
experts.token_weights routing), `clip` (each 2-bit row's range chosen by GPTQ's objective, experts.weights.clip_bits),
`tok8k` (the loss table on up to 8192 routed tokens per expert instead of 2048, experts.loss_tokens; the down fit
took the same cap until it was fitted on every routed token, and low_bits_tokens.json's rows were measured then);
allocators: 0-bit experts (skipped, router weight renormalised), the loss weighted by routing mass (pack.loss
layer), any width per expert (pack.order free) and one budget for all layers instead of one per layer (pack.schedule
model).

Peer rows (all linears but routers and the head at W2A16 or W3A16, groups of 32, asymmetric, weights only): hexq's
GPTQ (peer_recipe: act_order, then rounding optimised over each whole layer; `hexq-rtn`: the same tuning from round
to nearest, `hexq-float`: with float zero points), auto-round (signed-gradient rounding
and min/max tuning, --auto-round-iters steps per block, 200 by default, at --auto-round-lr, its defaults otherwise)
and llm-compressor's GPTQModifier. Every row: perplexity and the mean KL divergence of its next-token distributions
from the full-precision model's on the same windows (hexq.eval.divergence).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shutil
import time
from pathlib import Path

import torch

from hexq.artifact.reader import Artifact
from hexq.base.data import calibration_windows, eval_text, tokenize
from hexq.calib.calibrated import calibrated_model
from hexq.calib.pipeline import calibrate
from hexq.calib.store import read_manifest
from hexq.config.recipe import Experts, Pack, Recipe, WeightQuant, recipe_from_dict
from hexq.config.recipe_files import load_recipe
from hexq.eval.divergence import Divergence, token_divergence
from hexq.eval.perplexity import make_windows
from hexq.eval.run import kl_divergence, open_target
from hexq.pack.stage import Budget, make_plan, pack, read_stats
from hexq.packed.weight import PROJECTIONS
from hexq.runtime.model import artifact_model

from provenance import start_run, write_results

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"mixtral": ROOT / "models" / "hexq-tiny-mixtral", "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe"}
EVAL_DATA = ("austen", "pydocs", "foldoc")
SEQLEN = 256
MIXED_BITS = (1.5, 2.0, 2.5, 3.0)

# How the experts' replica bank is made (changes to experts-mixed's experts.weights / experts sections, from
# experts.down_fit full_precision and token_weights equal); "main" is the bank as hexq made it before these pieces
# (natural column order, min/max grids), "act+spread+float+down+routed" the bundled recipe's.
BLOCK_STEPS = 200  # AutoRound's default steps per block (the act+block bank setting)
# hexq's WbA16 rows: at 200 steps the layers' errors are still falling (reference Qwen3-MoE, W2A16: every layer's
# block error lower at 400, layer 0 0.0883 -> 0.0849, layer 3 0.194 -> 0.187), for twice the stage's time
PEER_STEPS = 400
INTEGER_ZERO = {"float_zero_bits": ()}
BUNDLED_BANK = {"act_order": "sum_of_squares", "one_bit": "spread", "float_zero_bits": (2,)}  # experts-mixed's
SETTINGS = {
    "main": {"weights": {"act_order": "none", "one_bit": "minmax", **INTEGER_ZERO}},
    "fit": {"weights": {"act_order": "none", "one_bit": "minmax", "fit_bits": (1, 2, 3, 4, 8), **INTEGER_ZERO}},
    "act": {"weights": {"act_order": "sum_of_squares", "one_bit": "minmax", **INTEGER_ZERO}},
    "act+round": {"weights": {"act_order": "sum_of_squares", "one_bit": "minmax", **INTEGER_ZERO},
                  "experts": {"round_bits": (1, 2)}},
    "act+spread": {"weights": {"act_order": "sum_of_squares", "one_bit": "spread", **INTEGER_ZERO}},
    "act+block": {"weights": {"act_order": "sum_of_squares", "one_bit": "minmax", **INTEGER_ZERO},
                  "experts": {"round_bits": (1, 2), "round_scope": "block", "round_steps": BLOCK_STEPS}},
    "act+spread+float": {"weights": BUNDLED_BANK},
    "act+spread+float23": {"weights": {**BUNDLED_BANK, "float_zero_bits": (2, 3)}},
    # changes measured on top of the bundled bank
    "act+spread+float+prop2": {"weights": BUNDLED_BANK, "experts": {"propagate_bits": 2}},
    "act+spread+float+fit": {"weights": {**BUNDLED_BANK, "fit_bits": (2, 3)}},
    "act+spread+float+round": {"weights": BUNDLED_BANK, "experts": {"round_bits": (1, 2)}},
    "act+spread+float+block": {"weights": BUNDLED_BANK, "experts": {"round_bits": (1, 2), "round_scope": "block",
                                                                    "round_steps": BLOCK_STEPS}},
    "act+spread+float+down": {"weights": BUNDLED_BANK, "experts": {"down_fit": "replica"}},
    "act+spread+float+down+refit": {"weights": {**BUNDLED_BANK, "refit_bits": (1, 2, 3, 4, 8)},
                                    "experts": {"down_fit": "replica"}},
    "act+spread+float+down+refit12": {"weights": {**BUNDLED_BANK, "refit_bits": (1, 2)},
                                      "experts": {"down_fit": "replica"}},
    "act+spread+float+down+damp0.05": {"weights": {**BUNDLED_BANK, "damp": 0.05}, "experts": {"down_fit": "replica"}},
    "act+spread+float+down+damp0.1": {"weights": {**BUNDLED_BANK, "damp": 0.1}, "experts": {"down_fit": "replica"}},
    "act+spread+float+down+routed": {"weights": BUNDLED_BANK,
                                     "experts": {"down_fit": "replica", "token_weights": "routing"}},
    "act+spread+float+down+routed+refit12": {"weights": {**BUNDLED_BANK, "refit_bits": (1, 2)},
                                             "experts": {"down_fit": "replica", "token_weights": "routing"}},
    "act+spread+float+down+routed+clip": {"weights": {**BUNDLED_BANK, "clip_bits": (2,)},
                                          "experts": {"down_fit": "replica", "token_weights": "routing"}},
    "act+spread+float+down+routed+clip+tok8k": {"weights": {**BUNDLED_BANK, "clip_bits": (2,)},
                                                "experts": {"down_fit": "replica", "token_weights": "routing",
                                                            "loss_tokens": 8192}},
}
# How `hexq pack` allocates (its pack section); "main" is the allocator before 0-bit experts and routing mass.
ALLOCATORS = {
    "main": Pack(widths=(1, 2, 3, 4)),
    "free": Pack(widths=(1, 2, 3, 4, 8), loss="layer", order="free"),
    "free+0": Pack(widths=(0, 1, 2, 3, 4, 8), loss="layer", order="free"),
    "model+0": Pack(widths=(0, 1, 2, 3, 4, 8), loss="layer", order="free", schedule="model"),
}
RECOMMENDED = "model+0"
PEER_WIDTHS = (2, 3)
PEERS = ("hexq", "auto-round", "llmcompressor")
PEER_METHODS = (*PEERS, "hexq-rtn", "hexq-float")  # hexq's peer row tuned from round to nearest, or float zeros


def bank_recipe(setting: str, samples: int, seed: int = 0) -> Recipe:
    recipe = load_recipe("experts-mixed")
    change = SETTINGS[setting]
    # the settings add these ("+down", "+routed", "+clip"): every setting keeps the meaning its rows were measured with
    experts = dataclasses.replace(recipe.experts, down_fit="full_precision", token_weights="equal")
    weights = dataclasses.replace(experts.weights, **{"clip_bits": (), **change.get("weights", {})})
    experts = dataclasses.replace(experts, weights=weights, **change.get("experts", {}))
    # the banks are compared with the head as stored (experts-mixed's 8-bit head adds ~1% KL divergence to every
    # row alike: benchmarks/head.py), as every row of the committed tables was measured
    return dataclasses.replace(recipe, name=f"experts-mixed-{setting}", experts=experts, head=None,
                               calibration=dataclasses.replace(recipe.calibration, num_samples=samples, seed=seed))


def peer_recipe(bits: int, samples: int, seed: int = 0, float_zero: bool = False, rtn: bool = False) -> Recipe:
    """hexq at WbA16 g32 on every linear (attention too), like the peers: GPTQ with act_order (static min/max
    grids: fitted ones lose there), then every matrix's rounding and scales optimised against each decoder layer's
    full-precision output (experts.round_scope block, PEER_STEPS steps, as auto-round tunes its blocks).
    float_zero: the grids span each group's min and max with a float zero point (weights.float_zero_bits), as
    auto-round's do, instead of an integer one. rtn: the tuning starts from round to nearest on the same min/max
    grids instead of GPTQ's replicas, as auto-round starts (measured: docs/packing-and-export.md)."""
    weights = WeightQuant(bits=bits, group_size=32, symmetric=False, method="rtn" if rtn else "gptq",
                          act_order="none" if rtn else "sum_of_squares", float_zero_bits=(bits,) if float_zero else ())
    experts = Experts(mode="uniform", round_bits=(bits,), round_scope="block", round_steps=PEER_STEPS)
    return recipe_from_dict({
        "name": f"w{bits}a16-g32", "smoothing": {"method": "none"}, "weights": dataclasses.asdict(weights),
        "activations": {"bits": None}, "experts": dataclasses.asdict(experts),
        "calibration": {"num_samples": samples, "seqlen": SEQLEN, "seed": seed}})


def percent(value: float, reference: float) -> str:
    return f"{value:.3f} ({100 * (value / reference - 1):+.2f}%)"


def cell(row: dict, fp: dict, source: str) -> str:
    """Perplexity (change against full precision) and, where measured, the mean KL divergence from it."""
    kld = row.get(f"{source}_kld")
    return percent(row[source], fp[source]) + (f" · {kld:.4f}" if kld is not None else "")


class Evaluator:
    """Perplexity and KL divergence from the full-precision model (hexq.eval.divergence: mean KLD per token, top-1
    agreement) on the first `windows` windows of every EVAL_DATA text, streamed (hexq targets) or in memory (the
    peers' models), the same windows for both."""

    def __init__(self, model_path: Path, windows: int) -> None:
        reference, tokenizer, prepare = open_target(model_path, torch.device("cpu"), None)
        self.tokenizer, self.reference = tokenizer, (reference, prepare)
        self.model_path = model_path
        self.windows = {source: make_windows(tokenize(tokenizer, eval_text(source)), SEQLEN, windows)
                        for source in EVAL_DATA}
        self.ids = torch.cat(list(self.windows.values()))

    def by_text(self, measured: Divergence) -> dict[str, float]:
        """{text: perplexity, text_kld: mean KLD, text_top1: top-1 agreement} from the per-token figures."""
        out, start = {}, 0
        for source, cut in self.windows.items():
            tokens = cut.shape[0] * (SEQLEN - 1)
            summary = measured[start:start + tokens].summary()
            out[source] = summary["perplexity"]
            out[f"{source}_kld"], out[f"{source}_top1"] = summary["kld_mean"], summary["top1_agreement"]
            start += tokens
        return out

    def streamed(self, streamed, prepare) -> dict[str, float]:
        return self.by_text(kl_divergence(streamed, prepare, self.reference, self.ids, 8, None, None))

    @functools.cached_property
    def reference_model(self):
        """The full-precision model in memory (float32), read once: the in-memory rows' reference."""
        from reference import load_model

        return load_model(self.model_path, device="cpu", dtype=torch.float32)[0]

    @torch.no_grad()
    def in_memory(self, model) -> dict[str, float]:
        model, reference = model.float(), self.reference_model
        parts = [token_divergence(model(window[None]).logits[0, :-1].float(),
                                  reference(window[None]).logits[0, :-1].float(), window[1:]) for window in self.ids]
        return self.by_text(Divergence.join(parts))

    def allocation(self, artifact: Artifact, allocation: list[list[int]]) -> dict[str, float]:
        """The artifact's model with every expert at allocation[layer][expert] (a skipped expert's routing weight
        goes to the token's kept experts, as `hexq eval` and `hexq run` serve it)."""
        streamed, _tokenizer, prepare = artifact_model(artifact, torch.device("cpu"), allocation=allocation)
        return self.streamed(streamed, prepare)


def bank_rows(name: str, setting: str, allocators: list[str], evaluator: Evaluator, work: Path, samples: int,
              add, seed: int = 0) -> None:
    """Uniform 2 and 3 bits and the mixed allocations of one calibration setting, each row given to add()."""
    calib = work / f"{name}-{setting}"
    started = time.time()
    calibrate(MODELS[name], bank_recipe(setting, samples, seed), "bundled", calib, force=True)
    seconds = round(time.time() - started, 1)
    art_dir = work / f"{name}-{setting}.hexq"
    pack(calib, art_dir, budget=Budget(avg_bits=3.0), overwrite=True, bank=("all",))
    artifact = Artifact(art_dir)
    manifest = read_manifest(calib)
    stats = read_stats(calib, manifest.moe_layers, None)
    recipe = manifest.recipe
    shapes = {p: artifact.expert_shape(p) for p in PROJECTIONS}
    layers, experts = len(artifact.moe_layers), artifact.num_experts
    for bits in (2, 3):
        add({"setting": setting, "allocator": "uniform", "bits": bits, "calib_seconds": seconds,
             **evaluator.allocation(artifact, [[bits] * experts] * layers)})
    for allocator in allocators:
        for avg in MIXED_BITS:
            plan = make_plan(stats, manifest.expert_bits, ALLOCATORS[allocator], Budget(avg_bits=avg), shapes,
                             recipe.expert_weights.group_size)
            add({"setting": setting, "allocator": allocator, "bits": avg, "calib_seconds": seconds,
                 "widths": {str(b): sum(row.count(b) for row in plan.allocation)
                            for b in sorted({b for row in plan.allocation for b in row})},
                 **evaluator.allocation(artifact, plan.allocation)})
    shutil.rmtree(calib, ignore_errors=True)
    shutil.rmtree(art_dir, ignore_errors=True)


def peer_rows(name: str, bits: int, evaluator: Evaluator, work: Path, samples: int, iters: int, lr: float | None,
              add, methods: tuple[str, ...] = PEERS, seed: int = 0) -> None:
    """hexq, auto-round and llm-compressor (those in `methods`) at WbA16 g32 on the same calibration windows, each
    row given to add()."""
    from llmcompressor_peer import PeerScheme, run_peer

    ids = calibration_windows(evaluator.tokenizer, "bundled", samples, SEQLEN, seed=seed).ids
    for method in ("hexq", "hexq-rtn", "hexq-float"):
        if method not in methods:
            continue
        out = work / f"{name}-w{bits}-{method}"
        started = time.time()
        recipe = peer_recipe(bits, samples, seed, float_zero=method == "hexq-float", rtn=method == "hexq-rtn")
        calibrate(MODELS[name], recipe, "bundled", out, force=True)
        seconds = round(time.time() - started, 1)
        streamed, _tokenizer, prepare = calibrated_model(out, torch.device("cpu"))
        add({"setting": f"w{bits}a16-g32", "allocator": method, "bits": bits, "calib_seconds": seconds,
             **evaluator.streamed(streamed, prepare)})
        shutil.rmtree(out, ignore_errors=True)
    for method, run in (("auto-round", lambda: auto_round_model(MODELS[name], bits, ids, iters, lr)),
                        ("llmcompressor", lambda: run_peer(MODELS[name], PeerScheme(
                            bits, weight_group_size=32, weight_symmetric=False), ids))):
        if method not in methods:
            continue
        started = time.time()
        model = run()
        seconds = round(time.time() - started, 1)
        add({"setting": f"w{bits}a16-g32", "allocator": method, "bits": bits, "calib_seconds": seconds,
             **evaluator.in_memory(model)})
        del model


def auto_round_model(folder: Path, bits: int, ids: torch.Tensor, iters: int, lr: float | None):
    """auto-round (intel/auto-round) on a float32 copy of the model, calibrated on exactly `ids` [n, L]: its
    fake-quantized model in memory (quantize() leaves the rounded weights in the model's Linears)."""
    from auto_round import AutoRound

    from reference import load_model

    model, tokenizer, _ = load_model(folder, device="cpu", dtype=torch.float32)
    data = [{"input_ids": row[None], "attention_mask": torch.ones(1, ids.shape[1], dtype=torch.long)} for row in ids]
    rounder = AutoRound(model, tokenizer, bits=bits, group_size=32, sym=False, dataset=data, nsamples=ids.shape[0],
                        seqlen=ids.shape[1], iters=iters, lr=lr, device_map="cpu")
    quantized, _layers = rounder.quantize()
    return quantized.eval()


def row_key(row: dict) -> tuple:
    return row["setting"], row["allocator"], row["bits"]


def earlier_results(path: Path, results: dict) -> dict:
    """The rows of an earlier results file at the same protocol (samples, windows), which --merge keeps where this
    run does not measure them again."""
    import json

    if not path.is_file():
        return results
    earlier = json.loads(path.read_text())
    protocol = ("samples", "windows", "seqlen", "eval_data", "seed")
    if any(earlier.get(key, 0 if key == "seed" else None) != results[key] for key in protocol):
        raise SystemExit(f"--merge: {path} holds another protocol "
                         f"({', '.join(f'{k} {earlier.get(k)}' for k in protocol)})")
    return results | {"models": earlier.get("models", {})}


def render(results: dict) -> str:
    lines = []
    for name, result in results["models"].items():
        fp = result["fp"]
        lines.append(f"\n{name}: perplexity (change against full precision) · mean KL divergence from full precision "
                     f"(nats per token), first {results['windows']} windows "
                     f"x {SEQLEN} of each held-out text; calibration {results['samples']} windows x {SEQLEN}")
        lines.append("| experts | bits | " + " | ".join(EVAL_DATA) + " | widths (experts per width) |")
        lines.append("|---|---|" + "---|" * len(EVAL_DATA) + "---|")
        lines.append("| full precision | 16 | " + " | ".join(f"{fp[s]:.3f}" for s in EVAL_DATA) + " | |")
        for row in result["rows"]:
            what = (f"{row['setting']}, {row['allocator']}" if row["allocator"] not in PEER_METHODS
                    else f"{row['allocator']} {row['setting']} (all linears)")
            widths = ", ".join(f"{b}: {n}" for b, n in row.get("widths", {}).items())
            lines.append(f"| {what} | {row['bits']} | " + " | ".join(cell(row, fp, s) for s in EVAL_DATA)
                         + f" | {widths} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS),
                        help="the bank settings' rows (none: the peer rows alone)")
    parser.add_argument("--samples", type=int, default=128, help="calibration windows of 256 tokens")
    parser.add_argument("--windows", type=int, default=64, help="evaluation windows of 256 tokens per text")
    parser.add_argument("--seed", type=int, default=0,
                        help="which calibration windows every row (hexq's and the peers') draws from the bundled text")
    parser.add_argument("--no-peers", action="store_true", help="skip the W2A16 / W3A16 g32 peer rows")
    parser.add_argument("--peer-bits", type=int, nargs="+", default=list(PEER_WIDTHS), choices=PEER_WIDTHS,
                        help="the peer rows' widths")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEER_METHODS,
                        help="the peer rows' methods (hexq-rtn: hexq's tuning from round to nearest; hexq-float: with "
                             "float zero points)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the output file that this run does not measure again (same samples and "
                             "windows), and their runs' records")
    parser.add_argument("--auto-round-iters", type=int, default=200, help="auto-round's steps per block (its default)")
    parser.add_argument("--auto-round-lr", type=float, default=None,
                        help="auto-round's learning rate (default: its own, 1 / iters); its 'light' preset: 50 at 5e-3")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "low_bits")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results" / "low_bits.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    record = start_run(args)
    results = {"samples": args.samples, "windows": args.windows, "seqlen": SEQLEN, "eval_data": list(EVAL_DATA),
               "seed": args.seed, "models": {}}
    if args.merge:
        results = earlier_results(args.out, results)
    args.work.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        evaluator = Evaluator(MODELS[name], args.windows)
        entry = results["models"].setdefault(name, {"rows": []})
        entry["fp"] = evaluator.streamed(*evaluator.reference)

        def add(row, model=name, rows=entry["rows"]):  # a partial run keeps every row evaluated so far
            same = [i for i, old in enumerate(rows) if row_key(old) == row_key(row)]
            if same:
                rows[same[0]] = row
            else:
                rows.append(row)
            print(model, row, flush=True)
            write_results(args.out, results, record, merged=args.merge)

        for setting in args.settings:
            allocators = list(ALLOCATORS) if setting == args.settings[-1] else ["main", RECOMMENDED]
            bank_rows(name, setting, allocators, evaluator, args.work, args.samples, add, args.seed)
        if not args.no_peers:
            for bits in args.peer_bits:
                peer_rows(name, bits, evaluator, args.work, args.samples, args.auto_round_iters, args.auto_round_lr,
                          add, tuple(args.peers), args.seed)
    write_results(args.out, results, record, complete=True, merged=args.merge)
    print(render(results))


if __name__ == "__main__":
    main()
