"""`hexq calibrate`: calibration windows through an MoE model layer by layer, streamed from its checkpoint (the GPTQ
schedule: layer l is calibrated on the outputs of the already-quantized layers below it).

Only one decoder layer is ever materialized (hexq.model.streaming.StreamedModel): its dense part in float32, its routed
experts in the checkpoint's dtype, upcast one chunk of experts at a time. The stages, in the order they run:

  open       `calibrate`: the model opened streamed (hexq.model.streaming.open_model), the recipe checked against its
             widths, the calibration windows drawn (hexq.base.data), the fingerprint of model, data and recipe taken,
             and the output folder opened or resumed (hexq.base.outputs; calib.store.layers_done says where to go on).
  per layer  `run_layers` -> `calibrate_layer`, three passes over the windows, the experts stood in for by an
             ExpertTap that records what they receive:
    A. smooth    calib.scales.smooth_layer: each smoothing group's s (003 §III.B.1, eq. 1-3: HAQ grid search of
                 e in s = max|X|^e, SmoothQuant's fixed alpha, or none), folded into the norm and its dense readers
                 (calib.fold) and kept as a column scale for the routed experts (applied when a chunk is upcast);
    B. quantize  calib.quantize.quantize_layer: Hessians of every quantized linear's input and router statistics
                 on the smoothed layer; GPTQ (eq. 4-6) or RTN for those linears; for the routed experts, chunk by
                 chunk, per-expert Hessians from the tokens routed to each and one replica per width from one
                 Hessian and one factorization (002 Alg. 1), bit-packed into the layer's bank file as they exist;
    C. loss      calib.loss_table.loss_table: the quantized layer (calib.calibrated.apply_dense_part: dequantized
                 weights + activation fake quantization) runs again; what the experts received gives, chunk by
                 chunk, the loss table L(l, e, b) (MSE of each replica against the full-precision expert on its
                 routed tokens, 002 §4.2) and the experts' output at `propagate_bits`: the next layer's inputs.
    record       calib.store.save_layer and progress.json (size and SHA-256 of every file): the resume point.
             A resumed run rebuilds the finished layers from their files (calib.calibrated) instead of A-C.
  head       with the recipe's `head` section, the LM head quantized on the last layer's outputs (hexq.calib.head).
  finish     the sealed manifest (recipe, fingerprint, per-layer reports, file records); the folder is renamed into
             place.

What later stages read: calib.store (the folder format, calibration_source), calib.calibrated.calibrated_model
(`hexq eval CALIBRATION`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hexq import __version__
from hexq.base.data import calibration_windows
from hexq.base.devices import peak_rss_bytes, resolve_device
from hexq.base.errors import HexqError
from hexq.base.hidden import HiddenStore
from hexq.base.io import write_json_atomic, write_sealed_json
from hexq.base.outputs import resumable_output_folder
from hexq.calib.block_rounding import model_outputs
from hexq.calib.calibrated import apply_dense_part, bank_replicas, calibrated_experts
from hexq.calib.capture import (
    quantized_linears,
)
from hexq.calib.fold import unsmoothed_linears
from hexq.calib.head import quantize_head
from hexq.calib.loss_table import loss_chunk, loss_table
from hexq.calib.quantize import compute_experts, default_expert_bits, expert_bits_list, quantize_layer
from hexq.calib.ranks import SINGLE, Ranks, join, leave
from hexq.calib.scales import smooth_layer
from hexq.calib.store import (
    FORMAT,
    FORMAT_VERSION,
    bank_path,
    differing_inputs,
    is_finished,
    layer_file_records,
    layer_meta,
    layers_done,
    load_layer,
    progress_files,
    read_json,
    save_head,
    save_layer,
    tensor_fingerprint,
    write_progress,
)
from hexq.config.fingerprint import calibration_hash
from hexq.config.model_check import validate_for_model
from hexq.config.recipe import Recipe, recipe_to_dict
from hexq.model.adapters import MoEAdapter
from hexq.model.folder import context_length, model_fingerprint
from hexq.model.layer_pass import run_layer
from hexq.model.simulate import (
    RoutedTokens,
)
from hexq.model.streaming import LoadedLayer, StreamedModel, open_model

Progress = Callable[[str, int, int], None]  # (what, done, total)
# Working memory for one chunk of experts' GPTQ (weights of every width stacked, Hessians and factors, float32).

Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass(frozen=True)
class CalibrationSummary:
    out: Path
    layers: int
    resumed_from: int  # layers found finished at start (-1: the run was already complete)
    fallback_experts: int
    seconds: float


# ------------------------------------------------------------------------------------------ one layer, whole run


def calibrate_layer(loaded: LoadedLayer, adapter: MoEAdapter, hidden: HiddenStore, kwargs: list[dict],
                    recipe: Recipe, index: int, device: torch.device, activation_limit: int | None,
                    folder: Path, progress: Progress | None, clock: StageClock,
                    ranks: Ranks = SINGLE, targets: HiddenStore | None = None) -> tuple[dict, dict, HiddenStore]:
    """Passes A-C of one layer (see the module docstring); the bank goes to `folder` (the calibration being written,
    which also takes spilled activations); each pass is a stage of `clock`. Returns the layer's other tensors, its
    report and its outputs. Across ranks (hexq.calib.ranks) the routed experts' work is split and every rank returns
    the same results. targets: the full-precision model's outputs of the layer, for block rounding."""
    tensors: dict[str, torch.Tensor] = {}
    smoothing, expert_scale = smooth_layer(loaded, adapter, hidden, kwargs, recipe, recipe.calibration.seed + index,
                                           tensors, ranks)
    clock.stage("smoothing")
    weights_of = compute_experts(loaded, expert_scale, device) if loaded.is_moe else None
    report, moe_sample = quantize_layer(loaded, adapter, hidden, kwargs, recipe, weights_of, tensors,
                                        bank_path(folder, index), progress, ranks, targets)
    clock.stage("quantize")
    apply_dense_part(loaded, adapter, tensors, recipe, fold=False)
    outputs = HiddenStore(activation_limit, folder)
    routed = run_layer(loaded, hidden, kwargs, outputs, experts=None)
    clock.stage("quantized pass")
    if routed is not None:
        propagate = calibrated_experts(loaded, tensors, recipe, default_expert_bits(recipe), device, folder)
        widths = expert_bits_list(recipe)
        chunk = loss_chunk(*loaded.shapes[1:], propagate.chunk, device)
        experts_out = loss_table(routed, weights_of, tensors, bank_replicas(loaded, device, folder), widths,
                                 default_expert_bits(recipe), (propagate.input_quant, propagate.mid_quant),
                                 moe_sample, loaded.act_fn, chunk, recipe.experts.loss_tokens, progress, ranks,
                                 recipe.experts.routing_weighted)
        add_expert_outputs(outputs, routed, experts_out)
        clock.stage("loss table")
    meta = {"layer": index, "smoothing": smoothing, "unsmoothed": unsmoothed_linears(loaded.module, adapter),
            **report}
    return tensors, meta, outputs


def same_outputs(outputs: HiddenStore, ranks: Ranks) -> None:
    """Every rank computed the dense part itself: check they agree (a float64 sum of the layer's outputs), so that
    ranks on different hardware or libraries fail here instead of calibrating from diverging inputs."""
    if not ranks.distributed:
        return
    checksum = sum(float(batch.double().sum()) for batch in outputs)
    sums = ranks.objects(checksum)
    if len(set(sums)) > 1:
        raise HexqError(f"the ranks computed different outputs for this layer ({', '.join(map(repr, sums))}): "
                        "every rank must run the same hardware kind, torch and hexq")


class StageClock:
    """Seconds of each stage of one layer's calibration (on a GPU measured to the end of its queued work), and the
    process's peak RSS at the end of each (a high-water mark: the stage where it rises is the one that needed it)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.peak_rss, self._last = device, {}, {}, time.perf_counter()

    def restart(self) -> None:
        """The next stage starts now (what ran since the last one belongs to none)."""
        self._last = time.perf_counter()

    def stage(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 3)
        self.peak_rss[name] = peak_rss_bytes()
        self._last = now


def add_expert_outputs(outputs: HiddenStore, routed: RoutedTokens, experts_out: torch.Tensor) -> None:
    """The layer's outputs with the experts stood in for by zeros, plus the experts' output (one batch at a time)."""
    for index, part in enumerate(routed.split(experts_out)):
        current = outputs[index]
        outputs[index] = current + part.reshape(current.shape)


def model_widths(streamed: StreamedModel) -> dict[str, int]:
    """Every quantized input width of the model, named, for the recipe's group-size check."""
    widths = {}
    for index in range(streamed.num_layers):
        shapes = streamed.expert_shapes(index)
        if shapes is not None:
            widths["expert intermediate size"] = shapes[2][1]
        for name, module in quantized_linears(streamed.layers[index], streamed.adapter).items():
            widths[f"{name.split('.', 1)[-1]} input"] = module.in_features
    return widths


def calibrate(model_path: str | Path, recipe: Recipe, data: str, out: str | Path, device: str | None = None,
              batch_size: int = 8, progress: Progress | None = None, activation_limit: int | None = None,
              force: bool = False) -> CalibrationSummary:
    """Calibrate `model_path` with `recipe` on `data` into the folder `out`.

    The work goes into the hidden sibling `.OUT.partial` (hexq.base.outputs.resumable_output_folder), one layer file at
    a time; a rerun after a kill resumes after the last finished layer, and the folder becomes OUT when the manifest
    is written. An existing OUT holding this very calibration is left as it is ("nothing to do"); any other
    non-empty OUT is replaced only with `force` and only if hexq wrote it. activation_limit: bytes of activations
    kept in memory per layer boundary (the rest spills to disk inside the partial folder).

    Started by torchrun (WORLD_SIZE > 1), the process is one rank of a calibration split across processes
    (hexq.calib.ranks): every rank calls this with the same arguments; rank 0 owns the folder."""
    started = time.time()
    model_path, out = Path(model_path), Path(out)
    ranks, device = join(resolve_device(device))
    try:
        return _calibrate(model_path, recipe, data, out, device, batch_size, progress if ranks.leader else None,
                          activation_limit, force, ranks, started)
    except HexqError as exc:
        raise HexqError(f"{ranks.where()}: {exc}" if ranks.distributed and not str(exc).startswith("rank ")
                        else str(exc)) from None
    finally:
        leave(ranks)


def _calibrate(model_path: Path, recipe: Recipe, data: str, out: Path, device: torch.device, batch_size: int,
               progress: Progress | None, activation_limit: int | None, force: bool, ranks: Ranks,
               started: float) -> CalibrationSummary:
    streamed, tokenizer = open_model(model_path, device)
    config = streamed.config
    validate_for_model(recipe, config.hidden_size, model_widths(streamed))
    context = context_length(config)
    if context and recipe.calibration.seqlen > context:
        raise HexqError(f"calibration seqlen {recipe.calibration.seqlen} exceeds the model's context of {context}")
    cal = recipe.calibration
    windows = calibration_windows(tokenizer, data, cal.num_samples, cal.seqlen, cal.seed)
    fingerprint = {"model": model_fingerprint(model_path), "data": tensor_fingerprint(windows.ids),
                   "recipe": calibration_hash(recipe)}
    num_layers = streamed.num_layers
    if is_finished(out, fingerprint):
        return CalibrationSummary(out, num_layers, -1, 0, time.time() - started)
    if not ranks.leader:  # rank 0 opens the folder and says where to start
        state = ranks.broadcast(None)
        if "error" in state:
            raise HexqError(f"rank 0 could not open {out}: {state['error']}")
        run_layers(streamed, tokenizer, recipe, windows, Path(state["path"]), fingerprint, state["done"], device,
                   batch_size, activation_limit, None, ranks, origin=("", ""))
        ranks.barrier("publishing the calibration")
        return CalibrationSummary(out, num_layers, state["done"], 0, time.time() - started)
    inputs = [model_path] + ([Path(data)] if Path(data).exists() else [])
    with ExitStack() as stack:
        try:
            work = stack.enter_context(resumable_output_folder(out, kind="calibration", force=force, inputs=inputs))
            done = layers_done(work.path, fingerprint) if work.resumed else 0
            if done is None:
                if not force:
                    raise HexqError(f"{work.path} holds an unfinished calibration of a different "
                                    f"{differing_inputs(work.path, fingerprint)}; pass --force to discard it and "
                                    "start over, or pick another output folder")
                work.clear()
                done = 0
            remove_stale_work(work.path)
            write_progress(work.path, fingerprint, done, progress_files(work.path))
        except BaseException as exc:
            ranks.broadcast({"error": str(exc)})  # the other ranks wait for the folder: tell them why not
            raise
        ranks.broadcast({"path": str(work.path), "done": done})
        manifest, fallback = run_layers(streamed, tokenizer, recipe, windows, work.path, fingerprint, done, device,
                                        batch_size, activation_limit, progress, ranks,
                                        origin=(str(model_path.resolve()), data))
        write_sealed_json(work.path / "manifest.json", manifest)
    ranks.barrier("publishing the calibration")
    return CalibrationSummary(out, num_layers, done, fallback, time.time() - started)


def remove_stale_work(folder: Path) -> None:
    """What a killed run leaves in the partial folder: spilled activations and bank files never published."""
    for stale in folder.glob(".hexq-activations-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in folder.glob(".layer_*.tmp"):
        stale.unlink(missing_ok=True)


def run_layers(streamed: StreamedModel, tokenizer, recipe: Recipe, windows, folder: Path, fingerprint: dict,
               done: int, device: torch.device, batch_size: int, activation_limit: int | None,
               progress: Progress | None, ranks: Ranks = SINGLE, *,
               origin: tuple[str, str]) -> tuple[dict, int] | None:
    """Calibrate layers done.. into `folder` (rebuilding layers ..done from their saved results); returns the
    manifest, naming `origin` (model path, data source), and the number of experts that fell back to a simpler
    quantizer (on rank 0; None on the other ranks, which write only their bank rows)."""
    config, adapter, num_layers = streamed.config, streamed.adapter, streamed.num_layers
    cal = recipe.calibration
    hidden = HiddenStore(activation_limit, folder)
    kwargs = streamed.layer_inputs(windows.ids, batch_size, hidden)
    # block rounding's targets come from the full-precision model: its activations are carried beside the
    # quantized ones (hexq.calib.block_rounding)
    reference = hidden.copy() if recipe.experts.round_scope == "block" else None
    timings = read_json(folder / "timings.json") or {}
    files = {name: record for name, record in progress_files(folder).items()
             if int(name[len("layer_"):len("layer_") + 3]) < done}
    for index in range(num_layers):
        ranks.layer = index
        layer_started = time.time()
        clock = StageClock(device)
        with streamed.layer(index, experts=index >= done or reference is not None) as loaded:
            clock.stage("load")  # read from the checkpoint onto the device
            targets = None
            if reference is not None:  # before anything is folded into the layer
                targets = model_outputs(loaded, reference, kwargs, compute_experts(loaded, None, device))
                clock.stage("full-precision pass")
            if index < done:  # resume: rebuild the quantized layer below from its saved results
                tensors, _ = load_layer(folder, index)
                apply_dense_part(loaded, adapter, tensors, recipe, fold=True)
                outputs = HiddenStore(activation_limit, folder)
                # summed in float64 like pass C's propagated output (loss_table): the same next-layer inputs as the
                # run that calibrated this layer
                experts = (replace(calibrated_experts(loaded, tensors, recipe, default_expert_bits(recipe), device,
                                                      folder), accumulate=torch.float64) if loaded.is_moe else None)
                run_layer(loaded, hidden, kwargs, outputs, experts)
            else:
                tensors, meta, outputs = calibrate_layer(loaded, adapter, hidden, kwargs, recipe, index, device,
                                                         activation_limit, folder, progress, clock, ranks, targets)
                same_outputs(outputs, ranks)
                every_rank = ranks.objects({"stages": dict(clock.seconds), "peak_rss_bytes": peak_rss_bytes(),
                                            "stage_peak_rss": dict(clock.peak_rss)})
                if ranks.leader:
                    clock.restart()
                    save_layer(folder, index, tensors, meta)
                    clock.stage("save")
                    files |= layer_file_records(folder, index)
                    timings[f"layer_{index:03d}"] = round(time.time() - layer_started, 2)
                    timings.setdefault("stages", {})[f"layer_{index:03d}"] = clock.seconds
                    timings.setdefault("peak_rss_bytes", {})[f"layer_{index:03d}"] = clock.peak_rss
                    if ranks.distributed:  # each rank's seconds per stage and peak RSS: imbalance shows here
                        timings.setdefault("ranks", {})[f"layer_{index:03d}"] = every_rank
                    write_json_atomic(folder / "timings.json", timings)
                    write_progress(folder, fingerprint, index + 1, files)
                ranks.barrier("recording the layer")
        hidden.close()
        hidden = outputs
        if reference is not None:
            reference.close()
            reference = targets
        if progress:
            progress("layers", index + 1, num_layers)
    try:
        if recipe.head is not None and ranks.leader:  # after the last layer, on its quantized outputs
            head_started = time.time()
            files |= save_head(folder, quantize_head(streamed, hidden, recipe.head, progress))
            timings["head"] = round(time.time() - head_started, 2)
            write_json_atomic(folder / "timings.json", timings)
    finally:
        hidden.close()
        if reference is not None:
            reference.close()
    ranks.layer = None
    if not ranks.leader:
        return None
    summaries = [layer_meta(folder, index) for index in range(num_layers)]
    num_experts = next(shape[0] for shape in streamed.moe_shapes if shape is not None)
    fallback = sum(len(meta.get("fallback_experts", [])) for meta in summaries)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "hexq_version": __version__, "fingerprint": fingerprint,
        "model": {"path": origin[0], "model_type": config.model_type, "layers": num_layers,
                  "moe_layers": [index for index in range(num_layers) if streamed.is_moe(index)],
                  "num_experts": num_experts, "top_k": config.num_experts_per_tok},
        "data": {"source": origin[1], "num_samples": cal.num_samples, "seqlen": cal.seqlen, "seed": cal.seed,
                 "tokens_available": windows.tokens_available},
        "recipe": recipe_to_dict(recipe),
        "expert_bits": list(expert_bits_list(recipe)),
        "fallback_experts": fallback,
        "layers": summaries,
        "files": dict(sorted(files.items())),
    }, fallback
