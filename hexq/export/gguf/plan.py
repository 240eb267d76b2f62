"""Which GGML type each tensor of an artifact becomes, and where each routed expert's blocks come from: decided
before anything is written, from the manifest alone.

Routed experts: one type per MoE layer and tensor (a fused `ffn_*_exps` tensor has one type, as a vLLM MoE layer has
one scheme). `--experts auto` takes the layer's type from its allocation (hexq.algos.gguf_layers.layer_type: the
class of its mean allocated width, 4-bit when K-quants cannot hold the rows), or one type for every layer:
- Q4_1 (asymmetric expert grid) / Q4_0 (symmetric): every expert allocated <= 4 bits is written with its GPTQ codes
  unchanged (x = s (q - z) is Q4_1's d q + m with d = s, m = -s z: exact up to the float16 rounding of m; a
  symmetric code is Q4_0's exactly); a wider one takes its stored 4-bit replica (`hexq pack --bank 4` or
  `--bank export`), else the export replica of the compressed-tensors export when it is on the same grid;
- Q2_K / Q3_K: every expert takes its GPTQ replica on the K-quant's own grid (`hexq calibrate --export-target gguf`,
  kept by `hexq pack --bank export`): codes on another grid do not fit a K-quant's quantized sub-block scales;
- Q8_0: symmetric codes of any width exactly; asymmetric ones re-rounded (Q8_0 has no zero point).
Under `auto` a layer whose type lacks a source for one of its experts (no K-quant replicas: the calibration was not
made with --export-target gguf; an 8-bit expert without a 4-bit replica: pack kept none) is written in the next
wider type that has one (the 4-bit type, then Q8_0: `plan_auto_layer`), and says so; a type named by --experts
refuses instead, naming what to pack or calibrate with.
An artifact that skips experts (0 bits) is refused (hexq.export.plan.refuse_skipped_experts).

Dense linears (attention, shared experts): their artifact code where a type holds it exactly (<= 4 bits: Q4_0 /
Q4_1; symmetric <= 8 bits: Q8_0), else Q8_0 round-to-nearest of the dequantized weight (`exact` says which).
Everything stored in float keeps its dtype (2-D) or becomes F32 (1-D: norms and biases, as llama.cpp reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hexq.algos.gguf_layers import four_bit_type, layer_type, wider_types
from hexq.base.errors import HexqError
from hexq.packed.ggml import BLOCK_TYPES, Q8_0, BlockType

EXPERT_MODES = ("auto", "q4", "q3_k", "q2_k", "q8_0")
KQUANT_OF_BITS = {2: "Q2_K", 3: "Q3_K"}


@dataclass(frozen=True)
class ExpertSource:
    """Where one routed expert's blocks come from: `source` exact | replica | export-replica | kquant | rtn,
    the stored width read (`bits`), and the allocated one."""

    expert: int
    allocated: int
    source: str
    bits: int


@dataclass(frozen=True)
class LayerPlan:
    layer: int  # model layer index
    row: int  # MoE row
    kind: BlockType
    experts: tuple[ExpertSource, ...]
    instead_of: str = ""  # --experts auto: the type the allocation asked for and why this one is written instead

    @property
    def projected(self) -> list[ExpertSource]:
        return [e for e in self.experts if e.source != "exact"]


def fits_blocks(group: int | None, cols: int, block: int) -> bool:
    """Whether per-group (or per-channel) parameters repeat exactly over `block`-weight blocks of a row."""
    return cols % block == 0 and (group or cols) % block == 0


def expert_type(mode: str, allocation: list[int], symmetric: bool, kquants_fit: bool) -> BlockType:
    if mode not in EXPERT_MODES:
        raise HexqError(f"unknown --experts {mode!r} for GGUF; choose one of {', '.join(EXPERT_MODES)}")
    if mode == "auto":
        return layer_type(allocation, symmetric, kquants_fit)
    if mode == "q4":
        return four_bit_type(symmetric)
    return BLOCK_TYPES[mode.upper()]


def plan_layer(layer: int, row: int, kind: BlockType, allocation: list[int], stored: list[list[int]],
               symmetric: bool, export_replicas: set[int], kquant_replicas: set[int]) -> LayerPlan:
    """Every expert's source in a `kind` layer. stored[e]: the widths the artifact keeps for expert e;
    export_replicas: experts with a 4-bit compressed-tensors export replica on the expert grid; kquant_replicas:
    experts with a `kind` K-quant replica."""
    experts = []
    for e, bits in enumerate(allocation):
        if kind.name in KQUANT_OF_BITS.values():
            if e not in kquant_replicas:
                raise HexqError(f"expert {e} of layer {layer} has no {kind.name} replica; calibrate with "
                                "--export-target gguf and pack with --bank export")
            experts.append(ExpertSource(e, bits, "kquant", int(kind.name[1])))
        elif kind == Q8_0:
            experts.append(ExpertSource(e, bits, "exact" if symmetric else "rtn", bits))
        elif bits <= 4:
            experts.append(ExpertSource(e, bits, "exact", bits))
        elif 4 in stored[e]:
            experts.append(ExpertSource(e, bits, "replica", 4))
        elif e in export_replicas:
            experts.append(ExpertSource(e, bits, "export-replica", 4))
        else:
            raise HexqError(f"expert {e} of layer {layer} is allocated {bits} bits and the artifact keeps no 4-bit "
                            f"replica of it for a {kind.name} layer; pack with --bank 4 (or --bank export)")
    return LayerPlan(layer, row, kind, tuple(experts))


def plan_auto_layer(layer: int, row: int, kind: BlockType, allocation: list[int], stored: list[list[int]],
                    symmetric: bool, export_replicas: set[int], kquant_replicas_of) -> LayerPlan:
    """`--experts auto`: the allocation's type `kind`, else the first wider type every expert has a source for
    (hexq.algos.gguf_layers.wider_types), so that an artifact packed without the export's replicas still exports;
    `instead_of` says what was asked and what was missing. kquant_replicas_of(name): experts with that K-quant's
    replica."""
    missing = ""
    for candidate in wider_types(kind, symmetric):
        try:
            plan = plan_layer(layer, row, candidate, allocation, stored, symmetric, export_replicas,
                              kquant_replicas_of(candidate.name))
        except HexqError as error:
            missing = missing or str(error)
            continue
        return plan if candidate == kind else replace(plan, instead_of=f"{kind.name}: {missing}")
    raise AssertionError("Q8_0 takes every expert")  # plan_layer never refuses a Q8_0 layer


def dense_type(bits: int, symmetric: bool, group: int | None, cols: int) -> tuple[BlockType, bool]:
    """(type, exact) of a quantized dense linear of `bits` on the recipe's weight grid."""
    if bits <= 4 and fits_blocks(group, cols, 32):
        return four_bit_type(symmetric), True
    if symmetric and fits_blocks(group, cols, 32):
        return Q8_0, True
    if cols % 32:
        raise HexqError(f"a dense linear of {cols} input columns has no GGUF block type (rows must be a multiple "
                        "of 32)")
    return Q8_0, False
