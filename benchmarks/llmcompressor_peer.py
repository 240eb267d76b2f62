"""The real peer: llmcompressor's `oneshot` on the same model and the same calibration windows as hexq.

hexq's numbers mean little alone; they have to sit next to what a user would get from llm-compressor
(vllm-project/llm-compressor 0.14, compressed-tensors 0.19) on the same model, calibration samples and
evaluation windows. This module builds that peer with as few choices of our own as possible:

- The recipe is written out as explicit compressed-tensors `config_groups` (QuantizationArgs with num_bits,
  type, symmetric, strategy, group_size, dynamic, observer) instead of preset names, so W6A6, W3A16 or W2A16
  are expressible and every setting is visible in `PeerScheme`.
- Fused transformers-5 experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) are handled
  by llmcompressor itself: `Oneshot.apply_recipe_modifiers` calls `modeling/moe/linearize.py: linearize_moe`,
  which swaps every fused experts module for a `LinearExperts2D` (`modeling/moe/linear_experts.py`): one
  `ExpertMLPWithGate` per expert with `gate_proj`/`up_proj`/`down_proj` nn.Linear copies of the fused slices.
  Those Linears are what gets calibrated and quantized, and they stay in the model after oneshot, so the
  model's forward runs the quantized experts (the fused tensors are gone).
- All experts are calibrated on all tokens (`moe_calibrate_all_experts=True`, llmcompressor's default:
  `modeling/moe/context.py: moe_calibration_context` makes `LinearExperts2D.forward` run each expert on every
  token while routing the outputs as usual). The flag is reset when oneshot returns, so evaluation routes.
- After oneshot every targeted Linear has `quantization_status == FROZEN` (< COMPRESSED), and
  compressed-tensors' `set_forward_quantized` wrapper fake-quantizes in forward: the weight from
  `weight_scale`/`weight_zero_point` (GPTQ already wrote dequantized grid values, so this is idempotent) and
  the input activations per token on the fly (dynamic) or with the calibrated `input_scale` (static).
- One correction: compressed-tensors computes "per-token" dynamic scales by keeping dims {0, 1} and reducing the
  rest (`quantization/utils/helpers.py: compute_dynamic_scales_and_zp`, written for [batch, seq, hidden]
  inputs, compressed-tensors #393/#394). Linearized experts receive 2-D [tokens, hidden] inputs, so nothing is
  reduced per row and the scale silently becomes ONE per tensor over all tokens routed to that expert in the
  batch, which also makes perplexity depend on the evaluation batch size. vLLM's kernels quantize MoE inputs
  per token, so `run_peer` lifts 2-D inputs of dynamic per-token Linears to [1, tokens, hidden] with a pair of
  hooks (`fix_token_scales=True`); pass False to measure the uncorrected HF emulation.
- The returned model lives in memory and is evaluated as is: a compressed Mixtral checkpoint written by
  llmcompressor reloads through plain `from_pretrained` with RANDOM experts and no error (its per-expert key
  names differ from what the fused transformers-5 model loads), so a reload would need a logits check against
  the in-memory model first, as `hexq export` does for its own checkpoints.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from hexq.base.errors import HexqError

from reference import load_model

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationScheme
    from torch.utils.data import DataLoader

# Modules never quantized: the output head, the routers (transformers-5 routers are not nn.Linear, so this is
# a guard for families whose router is one: PhiMoE's `router` is) and Qwen2-MoE's 1-wide shared-expert gate;
# llm-compressor's own
# MoE examples ignore the same.
PEER_IGNORE = ("lm_head", r"re:.*mlp\.gate$", r"re:.*mlp\.router$", r"re:.*mlp\.shared_expert_gate$")

# llmcompressor's calibration pipelines: "independent" (its default) gives each modifier its own pass and
# infers "sequential" (layer by layer, errors propagated) for SmoothQuant and GPTQ; "basic" runs whole-model
# forwards; both work on CPU.
Pipeline = Literal["independent", "sequential", "basic"]


@dataclass(frozen=True)
class PeerScheme:
    """One llmcompressor configuration, complete enough to rebuild the recipe.

    weight_group_size None means one scale per output channel. act_bits None means weight-only.
    act_dynamic True: symmetric per-token scales computed in forward; False: one static per-tensor scale from
    the calibration max (observer "static_minmax", the observer llmcompressor's own static presets use).
    method "gptq" is GPTQModifier (llmcompressor defaults: block 128, dampening 0.01, actorder "static");
    "rtn" is QuantizationModifier (round to nearest from min-max scales).
    """

    weight_bits: int
    weight_group_size: int | None = None
    weight_symmetric: bool = True
    act_bits: int | None = None
    act_dynamic: bool = True
    smoothquant: bool = False
    smoothquant_alpha: float = 0.5
    method: Literal["gptq", "rtn"] = "gptq"

    def __post_init__(self) -> None:
        if not 2 <= self.weight_bits <= 8:
            raise HexqError(f"weight_bits must be 2..8, got {self.weight_bits}")
        if self.act_bits is not None and not 2 <= self.act_bits <= 8:
            raise HexqError(f"act_bits must be 2..8 or None (weight-only), got {self.act_bits}")
        if self.weight_group_size is not None and self.weight_group_size <= 0:
            raise HexqError(f"weight_group_size must be positive or None (per channel), got {self.weight_group_size}")
        if self.method not in ("gptq", "rtn"):
            raise HexqError(f"method must be 'gptq' or 'rtn', got {self.method!r}")
        if not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise HexqError(f"smoothquant_alpha must be in [0, 1], got {self.smoothquant_alpha}")


def _wxax(weight_bits: int, act_bits: int) -> PeerScheme:
    return PeerScheme(weight_bits, act_bits=act_bits, act_dynamic=True, smoothquant=True)


PEER_SCHEMES: dict[str, PeerScheme] = {
    "w8a8-dyn": _wxax(8, 8),
    "w8a8-static": PeerScheme(8, act_bits=8, act_dynamic=False, smoothquant=True),
    "w6a6": _wxax(6, 6),
    "w4a8": _wxax(4, 8),
    "w4a4": _wxax(4, 4),
    "w4a16-g32": PeerScheme(4, weight_group_size=32),
    "w4a16": PeerScheme(4),
    "w3a16": PeerScheme(3),
    "w2a16": PeerScheme(2),
}


def peer_scheme(scheme: str | PeerScheme) -> PeerScheme:
    """A PeerScheme from its name in PEER_SCHEMES (or the scheme itself)."""
    if isinstance(scheme, PeerScheme):
        return scheme
    if scheme not in PEER_SCHEMES:
        raise HexqError(f"unknown peer scheme {scheme!r}; known: {', '.join(PEER_SCHEMES)}")
    return PEER_SCHEMES[scheme]


def quantization_scheme(scheme: PeerScheme) -> QuantizationScheme:
    """The compressed-tensors QuantizationScheme (targets: every nn.Linear) that `scheme` describes."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=scheme.weight_bits,
        type="int",
        symmetric=scheme.weight_symmetric,
        strategy="channel" if scheme.weight_group_size is None else "group",
        group_size=scheme.weight_group_size,
        dynamic=False,
        observer="memoryless_minmax",  # llmcompressor's default weight observer, stated explicitly
    )
    inputs = None
    if scheme.act_bits is not None:
        inputs = QuantizationArgs(
            num_bits=scheme.act_bits,
            type="int",
            symmetric=True,
            strategy="token" if scheme.act_dynamic else "tensor",
            dynamic=scheme.act_dynamic,
            observer=None if scheme.act_dynamic else "static_minmax",
        )
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def build_recipe(scheme: PeerScheme) -> list:
    """llmcompressor modifiers for `scheme`: optional SmoothQuant (its MoE mappings smooth attention inputs
    only), then GPTQ or RTN over every Linear except PEER_IGNORE."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    recipe: list = []
    if scheme.smoothquant:
        recipe.append(SmoothQuantModifier(smoothing_strength=scheme.smoothquant_alpha))
    modifier = GPTQModifier if scheme.method == "gptq" else QuantizationModifier
    recipe.append(modifier(config_groups={"group_0": quantization_scheme(scheme)}, ignore=list(PEER_IGNORE)))
    return recipe


def causal_mask(seqlen: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive causal mask [1, seqlen, seqlen]: 0 where a query may attend, dtype-min above the diagonal."""
    blocked = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)
    return torch.zeros(1, seqlen, seqlen, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


def calibration_loader(calib_ids: torch.Tensor, batch_size: int = 1, explicit_causal_mask: bool = True,
                       dtype: torch.dtype = torch.float32) -> DataLoader:
    """The windows as the DataLoader oneshot consumes (it skips its own tokenization, sampling and collation
    for a DataLoader): every window once, in order, no truncation or padding.

    explicit_causal_mask: give each window a 4-D additive causal mask instead of a 2-D all-ones mask. The
    sequential pipeline traces the model with the config rebuilt from its dataclass fields, which drops
    `_attn_implementation`; the traced `create_causal_mask` then returns None, and the decoder layers (forced
    to eager attention during calibration) attend BIDIRECTIONALLY. A 4-D mask is returned as is by
    `create_causal_mask`, so calibration sees the causal activations the model produces at inference.
    """
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    if calib_ids.ndim != 2 or calib_ids.shape[0] == 0 or calib_ids.shape[1] < 2:
        raise HexqError(f"calibration ids must be [n, seqlen] with n >= 1 and seqlen >= 2, got {list(calib_ids.shape)}")
    if batch_size < 1:
        raise HexqError(f"batch_size must be at least 1, got {batch_size}")
    ids = calib_ids.to(torch.long).cpu()
    mask = causal_mask(ids.shape[1], dtype) if explicit_causal_mask else torch.ones(ids.shape[1], dtype=torch.long)
    samples = [{"input_ids": row, "attention_mask": mask} for row in ids]
    return DataLoader(samples, batch_size=batch_size, shuffle=False, collate_fn=default_data_collator)


def run_peer(model_folder: str | Path, scheme: str | PeerScheme, calib_ids: torch.Tensor,
             pipeline: Pipeline = "independent", batch_size: int = 1, fix_causal_mask: bool = True,
             fix_token_scales: bool = True, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """llmcompressor oneshot on a fresh fp32 copy of the model, calibrated on exactly `calib_ids` [n, L].

    Every window is used once (no shuffling, truncation or padding). Returns the in-memory quantized model in
    eval mode, ready for `perplexity(...)`; its experts are llmcompressor's linearized per-expert Linears with
    fake quantization in forward. The two fixes (both on by default, so hexq is not compared with a peer
    handicapped by stack bugs; turn them off to measure the peer exactly as shipped): `fix_causal_mask`, see
    `calibration_loader`; `fix_token_scales`, see the module docstring. dtype: what the model is loaded in
    (float32 for quality comparisons on small models; a real-size user loads the checkpoint's bf16).
    """
    from llmcompressor import oneshot

    spec = peer_scheme(scheme)
    loader = calibration_loader(calib_ids, batch_size, explicit_causal_mask=fix_causal_mask, dtype=dtype)
    model, tokenizer, _ = load_model(model_folder, device="cpu", dtype=dtype)
    model = oneshot(
        model=model,
        processor=tokenizer,
        recipe=build_recipe(spec),
        dataset=loader,
        pipeline=pipeline,
        moe_calibrate_all_experts=True,
    )
    if fix_token_scales:
        per_token_rows(model)
    return model.eval()


class _TokenRows:
    """Forward hooks that run one Linear on [1, tokens, hidden] when it is called with [tokens, hidden], so
    compressed-tensors' dynamic TOKEN scales (which keep dims 0 and 1) come out one per token."""

    def __init__(self) -> None:
        self.lifted = False

    def before(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        self.lifted = args[0].ndim == 2
        return (args[0].unsqueeze(0), *args[1:]) if self.lifted else None

    def after(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return output.squeeze(0) if self.lifted else None


def per_token_rows(model: torch.nn.Module) -> int:
    """Attach `_TokenRows` to every Linear whose input is quantized dynamically per token; the number of
    Linears changed. The hooks live as long as the model (they are part of its quantized forward)."""
    count = 0
    for module in model.modules():
        inputs = getattr(getattr(module, "quantization_scheme", None), "input_activations", None)
        if isinstance(module, torch.nn.Linear) and inputs is not None and inputs.dynamic is True \
                and inputs.strategy == "token":
            rows = _TokenRows()
            module.register_forward_pre_hook(rows.before)
            module.register_forward_hook(rows.after)
            count += 1
    return count


def peer_cost(model_folder: str | Path, scheme: str | PeerScheme, calib_ids: torch.Tensor,
              pipeline: Pipeline = "independent", include_startup: bool = True,
              timeout: float | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of `run_peer` in a fresh Python process.

    A separate process so the peak RSS is the peer's alone (the OS's ru_maxrss of that child, read with
    os.wait4), not this process's history. With include_startup the time covers the whole process (imports,
    model load, oneshot), as timing a `hexq calibrate` command would; otherwise only `run_peer` after the
    imports (model load + oneshot). The RSS always includes the imported libraries (about 0.5 GB here).
    """
    spec = peer_scheme(scheme)
    with tempfile.TemporaryDirectory(prefix="hexq-peer-") as tmp:
        tmp_path = Path(tmp)
        torch.save(calib_ids.to(torch.long).cpu(), tmp_path / "calib.pt")
        job = {"model": str(Path(model_folder).resolve()), "scheme": asdict(spec), "pipeline": pipeline}
        (tmp_path / "job.json").write_text(json.dumps(job))
        code = "import sys; from llmcompressor_peer import _cost_child; _cost_child(sys.argv[1])"
        env = dict(os.environ)
        here = Path(__file__).resolve().parent  # benchmarks/, and the project root above it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(here), str(here.parent), env.get("PYTHONPATH")) if p)
        with open(tmp_path / "child.log", "wb") as log:
            start = time.perf_counter()
            process = subprocess.Popen([sys.executable, "-c", code, tmp], stdout=log, stderr=subprocess.STDOUT,
                                       env=env)
            try:
                _, status, usage = _wait4(process, timeout)
            finally:
                if process.returncode is None and process.poll() is None:
                    process.kill()
                    process.wait()
            wall = time.perf_counter() - start
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0:
            tail = (tmp_path / "child.log").read_text(errors="replace").splitlines()[-15:]
            raise HexqError(f"llmcompressor peer process failed (exit {exit_code}):\n" + "\n".join(tail))
        report = json.loads((tmp_path / "report.json").read_text())
    seconds = wall if include_startup else float(report["run_seconds"])
    return seconds, int(usage.ru_maxrss) * 1024  # Linux reports ru_maxrss in KiB


def _wait4(process: subprocess.Popen, timeout: float | None) -> tuple[int, int, resource.struct_rusage]:
    """os.wait4 on one child (its own rusage, unlike RUSAGE_CHILDREN which is a max over all children)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG if deadline is not None else 0)
        if pid == process.pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return pid, status, usage
        if deadline is not None and time.monotonic() > deadline:
            raise HexqError(f"llmcompressor peer process did not finish within {timeout} s")
        time.sleep(0.05)


def _cost_child(job_dir: str) -> None:
    """Entry point of the peer_cost child process: run the peer once and write the oneshot time."""
    import llmcompressor.modifiers.transform.smoothquant  # noqa: F401  (imports are startup, not calibration)
    from llmcompressor import oneshot  # noqa: F401

    folder = Path(job_dir)
    job = json.loads((folder / "job.json").read_text())
    calib_ids = torch.load(folder / "calib.pt")
    start = time.perf_counter()
    run_peer(job["model"], PeerScheme(**job["scheme"]), calib_ids, pipeline=job["pipeline"])
    elapsed = time.perf_counter() - start
    (folder / "report.json").write_text(json.dumps({"run_seconds": elapsed}))
