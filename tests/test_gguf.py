"""hexq export --format gguf: block codecs against gguf-py, exactness of hexq's codes in GGML blocks, GPTQ on the
K-quant grid, and exports of tiny models checked by gguf-py (and by llama.cpp where llama-cpp-python is installed)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from hexq.algos.gptq import factorize_hessians
from hexq.algos.kquant import gptq_kquant, kquant_blocks, rtn_kquant
from hexq.algos.quant import QuantSpec, quantize
from hexq.base.errors import HexqError
from hexq.export.gguf.check import llama_available
from hexq.packed import ggml as B
from hexq.packed.ggml import packed_blocks
from hexq.packed.weight import dequantize_packed, pack_weight
from tests.conftest import IN_CI

GEN = torch.Generator().manual_seed(0)


def gguf_py(kind: B.BlockType, raw: torch.Tensor) -> torch.Tensor:
    """gguf-py's own dequantization of blocks [rows, row_bytes]."""
    return torch.from_numpy(np.array(quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(kind.ggml))))


def per_block(values: torch.Tensor, size: int) -> torch.Tensor:
    return values.repeat_interleave(size, 1)


# ------------------------------------------------------------------------------------------ block codecs


def test_every_block_type_decodes_in_gguf_py_to_its_formula():
    rows, cols = 3, 512
    d = torch.rand(rows, cols // 32, generator=GEN).half().float()
    m = -torch.rand(rows, cols // 32, generator=GEN).half().float()
    q8 = torch.randint(-128, 128, (rows, cols), generator=GEN).to(torch.int8)
    q4 = torch.randint(0, 16, (rows, cols), generator=GEN).to(torch.uint8)
    q2 = torch.randint(0, 4, (rows, cols), generator=GEN).to(torch.uint8)
    u3 = torch.randint(0, 8, (rows, cols), generator=GEN).to(torch.uint8)
    sc2, mins = (torch.randint(0, 16, (rows, cols // 16), generator=GEN) for _ in range(2))
    sc3 = torch.randint(-32, 32, (rows, cols // 16), generator=GEN)
    dk, dmin = (torch.rand(rows, cols // 256, generator=GEN).half().float() for _ in range(2))
    cases = [
        (B.Q8_0, B.encode_q8_0(q8, d), q8.float() * per_block(d, 32)),
        (B.Q4_0, B.encode_q4_0(q4, d), (q4.float() - 8) * per_block(d, 32)),
        (B.Q4_1, B.encode_q4_1(q4, d, m), q4.float() * per_block(d, 32) + per_block(m, 32)),
        (B.Q2_K, B.encode_q2_k(q2, sc2, mins, dk, dmin),
         per_block(per_block(dk, 16) * sc2, 16) * q2.float() - per_block(per_block(dmin, 16) * mins, 16)),
        (B.Q3_K, B.encode_q3_k(u3, sc3, dk), per_block(per_block(dk, 16) * sc3, 16) * (u3.float() - 4)),
    ]
    for kind, raw, formula in cases:
        assert raw.shape == (rows, kind.row_bytes(cols))
        theirs = gguf_py(kind, raw)
        torch.testing.assert_close(theirs, formula, rtol=2.0 ** -23, atol=0, msg=kind.name)
        assert torch.equal(B.decode(kind, raw, cols), theirs), kind.name


# ------------------------------------------------------------------------------------------ hexq's codes


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("group", [32, 128, None])
def test_q4_1_carries_gptq_codes_exactly_up_to_the_float16_rounding_of_m(bits, group):
    w = torch.randn(16, 256, generator=GEN)
    codes, meta = quantize(w, QuantSpec(bits=bits, group_size=group, symmetric=False))
    packed = pack_weight(codes, meta)
    hexq = dequantize_packed(packed)
    raw = packed_blocks(packed, False, B.Q4_1)
    written = gguf_py(B.Q4_1, raw)
    # x = d q + m with d = s and m = -z s rounded once to float16: |error| <= half an ulp of m (2^-11 |m|), plus one
    # float32 rounding of each side's arithmetic
    m = raw.reshape(16, -1, 20)[..., 2:4].contiguous().view(torch.float16).float().abs()[..., 0]
    bound = per_block(m, 32) * 2.0 ** -11 + (hexq.abs() + per_block(m, 32)) * 2.0 ** -23
    assert ((written - hexq).abs() <= bound).all()


@pytest.mark.parametrize(("bits", "kind"), [(1, B.Q4_0), (3, B.Q4_0), (4, B.Q4_0), (2, B.Q8_0), (8, B.Q8_0)])
def test_symmetric_codes_are_bit_exact_in_q4_0_and_q8_0(bits, kind):
    w = torch.randn(8, 128, generator=GEN)
    packed = pack_weight(*quantize(w, QuantSpec(bits=bits, group_size=64, symmetric=True)))
    assert torch.equal(gguf_py(kind, packed_blocks(packed, True, kind)), dequantize_packed(packed))


def test_asymmetric_eight_bit_code_is_re_rounded_within_half_a_q8_0_step():
    w = torch.randn(8, 128, generator=GEN)
    packed = pack_weight(*quantize(w, QuantSpec(bits=8, group_size=None, symmetric=False)))
    raw = packed_blocks(packed, False, B.Q8_0)
    step = raw.reshape(8, -1, 34)[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    error = (gguf_py(B.Q8_0, raw) - dequantize_packed(packed)).abs()
    assert (error <= per_block(step, 32) * (0.5 + 2.0 ** -10)).all()


# ------------------------------------------------------------------------------------------ K-quant GPTQ


def correlated_problem(experts: int = 2, rows: int = 32, cols: int = 512, tokens: int = 1024):
    """Weights and the Hessian 2 X^T X of inputs with correlated, unevenly scaled channels (as activations are)."""
    mix = torch.randn(cols, cols, generator=GEN) / cols ** 0.5 + torch.eye(cols)
    x = torch.randn(experts, tokens, cols, generator=GEN) @ mix * torch.rand(cols, generator=GEN).add(0.1) * 3
    return torch.randn(experts, rows, cols, generator=GEN) * 0.02, 2 * x.transpose(1, 2) @ x


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K"])
def test_gptq_on_the_k_quant_grid_beats_round_to_nearest_and_its_blocks_are_what_llama_cpp_reads(kind):
    w, h = correlated_problem()
    importance = torch.diagonal(h, dim1=1, dim2=2)
    gptq = gptq_kquant(w, factorize_hessians(h), importance, kind)
    rtn = rtn_kquant(w, importance, kind)

    def output_error(result) -> float:  # ||dW X||^2 summed over experts: tr(dW H dW^T) / 2
        dw = result.dequantize() - w
        return float(torch.einsum("eoi,eij,eoj->", dw, h, dw)) / 2

    assert output_error(gptq) < 0.9 * output_error(rtn)
    blocks = kquant_blocks(gptq).reshape(w.shape[0], w.shape[1], -1)
    for expert in range(w.shape[0]):
        torch.testing.assert_close(gguf_py(B.BLOCK_TYPES[kind], blocks[expert]), gptq.dequantize()[expert],
                                   rtol=2.0 ** -22, atol=0)


def test_k_quant_rows_must_be_whole_super_blocks():
    w, h = correlated_problem(cols=192)
    with pytest.raises(ValueError, match="multiple of 256"):
        rtn_kquant(w, torch.diagonal(h, dim1=1, dim2=2), "Q3_K")


# ------------------------------------------------------------------------------------------ exports


def gguf_model(folder, model_type: str, **overrides):
    """A tiny random checkpoint whose widths llama.cpp's block types take (rows of 256: K-quants too)."""
    from transformers import AutoTokenizer

    from tests.conftest import TOKENIZER_DIR, build_tiny_model

    widths = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=4 if model_type == "olmoe" else 2)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        widths |= dict(moe_intermediate_size=256, head_dim=64)
    if model_type == "qwen3_moe":
        widths |= dict(norm_topk_prob=True, num_experts=4)  # llama.cpp's qwen3moe renormalizes (as Qwen3 does)
    if model_type == "qwen2_moe":
        widths |= dict(shared_expert_intermediate_size=256)
    # weights large enough that attention is not uniform: rope and head layout then change the output
    widths |= dict(initializer_range=0.1)
    build_tiny_model(model_type, **(widths | overrides)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gguf_calibration(tmp_path_factory):
    from hexq.calib.pipeline import calibrate
    from tests.conftest import small_recipe

    model = gguf_model(tmp_path_factory.mktemp("gguf-model"), "qwen3_moe")
    out = tmp_path_factory.mktemp("gguf-cal") / "cal"
    calibrate(model, small_recipe("experts-gguf"), "bundled", out)
    return out


@pytest.fixture(scope="module")
def k_artifact(gguf_calibration, tmp_path_factory):
    """Packed at 3 bits: K-quant layers (Q3_K), the replicas kept by pack.export_replicas."""
    from hexq.pack.stage import pack

    out = tmp_path_factory.mktemp("gguf-pack") / "k3.hexq"
    pack(gguf_calibration, out)
    return out


def test_k_quant_export_passes_its_check_and_holds_the_calibrated_replicas(k_artifact, tmp_path):
    from hexq.export.gguf.command import export_gguf

    summary = export_gguf(k_artifact, tmp_path / "m.gguf")
    assert [layer.kind.name for layer in summary.plan.layers] == ["Q3_K", "Q3_K"]
    assert summary.check.passed and (tmp_path / "m.gguf").is_file()
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down_exps.weight"] == "Q3_K" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert not list(tmp_path.glob(".m.gguf*"))


def test_four_bit_export_writes_the_gptq_codes(gguf_calibration, tmp_path):
    from hexq.export.gguf.command import export_gguf
    from hexq.pack.stage import Budget, pack

    artifact = tmp_path / "b4.hexq"
    pack(gguf_calibration, artifact, budget=Budget(avg_bits=4.0))
    summary = export_gguf(artifact, tmp_path / "m.gguf", check=False)
    assert {layer.kind.name for layer in summary.plan.layers} == {"Q4_1"}
    assert all(e.source == "exact" for layer in summary.plan.layers for e in layer.experts)


def test_a_wrong_block_fails_the_check_and_leaves_no_file(k_artifact, tmp_path, monkeypatch):
    import hexq.export.gguf.write as export

    real = export.expert_blocks

    def off_by_one(artifact, layer, source, projection):
        blocks = real(artifact, layer, source, projection)
        if layer.layer == 1 and source.expert == 2 and projection == "down":
            blocks = blocks.clone()
            blocks[0, 0] ^= 1  # one code bit of one weight
        return blocks

    monkeypatch.setattr(export, "expert_blocks", off_by_one)
    monkeypatch.setattr("hexq.export.gguf.command.llama_available", lambda: False)
    from hexq.export.gguf.command import export_gguf

    with pytest.raises(HexqError, match="blk.1.ffn_down_exps.weight"):
        export_gguf(k_artifact, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_one_line_errors_name_what_to_use(gguf_calibration, tmp_path):
    from transformers import AutoConfig

    from hexq.config.recipe import Pack
    from hexq.export.gguf.arch import family_of
    from hexq.export.gguf.command import export_gguf
    from hexq.pack.stage import pack

    plain = tmp_path / "plain.hexq"  # no export replicas: no K-quant blocks for a 3-bit layer
    pack(gguf_calibration, plain, settings=Pack(widths=(2, 3, 4), avg_bits=3.0))
    with pytest.raises(HexqError, match="--export-target gguf and pack with --bank export"):
        export_gguf(plain, tmp_path / "m.gguf", experts="q3_k")  # a type named: refused, saying what to do
    assert not (tmp_path / "m.gguf").exists()
    skips = tmp_path / "skips.hexq"  # llama.cpp would run a skipped expert as zeros, its routing weight lost
    pack(gguf_calibration, skips, settings=Pack(widths=(0, 2, 3, 4), avg_bits=1.5))
    with pytest.raises(HexqError, match=r"skips \d+ routed expert.*GGUF has no way to say so.*pack.widths without 0"):
        export_gguf(skips, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(HexqError, match="deepseek_v2 is not among them"):
        family_of(AutoConfig.for_model("deepseek_v2"))
    with pytest.raises(HexqError, match="norm_topk_prob"):
        family_of(AutoConfig.for_model("qwen3_moe", norm_topk_prob=False))


def test_cli_gguf_export_refuses_to_overwrite_and_writes_a_report(k_artifact, tmp_path):
    from typer.testing import CliRunner

    from hexq_cli.main import app

    out, report = tmp_path / "m.gguf", tmp_path / "r.json"
    result = CliRunner().invoke(app, ["export", str(k_artifact), "--format", "gguf", "-o", str(out), "--json",
                                      str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["check"]["passed"] and data["experts"][0]["type"] == "Q3_K"
    again = CliRunner().invoke(app, ["export", str(k_artifact), "--format", "gguf", "-o", str(out)])
    assert again.exit_code == 1 and "--force" in again.output


# .ci/run installs the binding against the llama.cpp it builds (scripts/llama_cpp.sh): there these tests must run.
LLAMA = pytest.mark.skipif(not llama_available() and not IN_CI,
                           reason="llama-cpp-python is not installed (pip install 'hexq[gguf]')")


def test_auto_writes_a_wider_type_where_a_source_is_missing(tmp_path):
    """`hexq pack --bits B` then `hexq export --format gguf` on an experts-mixed calibration (no export replicas):
    under --experts auto a 3-bit layer without K-quant replicas is written Q4 (hexq's codes exactly), a 4-bit layer
    holding 8-bit experts without 4-bit replicas Q8_0, each saying what it stands in for; the file checks against
    what hexq serves."""
    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import Pack
    from hexq.export.gguf.command import export_gguf
    from hexq.pack.stage import Budget, pack
    from tests.conftest import small_recipe

    gguf_calibration = tmp_path / "cal"
    calibrate(gguf_model(tmp_path / "model", "qwen3_moe"), small_recipe("experts-mixed"), "bundled", gguf_calibration)

    for name, widths, average, wanted, written in (("three", (2, 3, 4), 3.0, "Q3_K", {"Q4_0", "Q4_1"}),
                                                   ("eights", (2, 4, 8), 5.0, "Q4_", {"Q8_0"})):
        artifact = tmp_path / f"{name}.hexq"
        pack(gguf_calibration, artifact, settings=Pack(widths=widths, avg_bits=average),
             budget=Budget(avg_bits=average))
        summary = export_gguf(artifact, tmp_path / f"{name}.gguf", windows=2, seqlen=32)
        fallen = [layer for layer in summary.plan.layers if layer.instead_of]
        assert fallen and all(layer.kind.name in written and layer.instead_of.startswith(wanted) for layer in fallen)
        assert summary.check.passed


@LLAMA
def test_llama_cpp_runs_the_export_as_hexq_does(k_artifact, tmp_path):
    from hexq.export.gguf.command import export_gguf

    summary = export_gguf(k_artifact, tmp_path / "m.gguf", windows=2, seqlen=64)
    assert summary.check.engine == "llama.cpp" and summary.check.passed


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"])
def test_every_family_llama_cpp_runs_is_exported_and_checked(family, tmp_path):
    """calibrate -> pack (4 bits) -> export: checked by llama.cpp where it is installed, by gguf-py otherwise."""
    from hexq.calib.pipeline import calibrate
    from hexq.export.gguf.command import export_gguf
    from hexq.pack.stage import Budget, pack
    from tests.conftest import small_recipe

    model = gguf_model(tmp_path / "model", family)
    calibrate(model, small_recipe("experts-gguf"), "bundled", tmp_path / "cal")
    pack(tmp_path / "cal", tmp_path / "a.hexq", budget=Budget(avg_bits=4.0))
    summary = export_gguf(tmp_path / "a.hexq", tmp_path / "m.gguf", windows=2, seqlen=64)
    assert summary.check.passed and summary.check.engine == ("llama.cpp" if llama_available() else "gguf-py")


@LLAMA
@pytest.mark.slow
def test_llama_cpp_check_catches_rows_llama_cpp_reads_otherwise(tmp_path, monkeypatch):
    """Without the rope permutation a Mixtral GGUF holds every weight hexq serves (the block check passes) and
    llama.cpp still computes another model: its check must fail."""
    from hexq.calib.pipeline import calibrate
    from hexq.export.gguf.command import export_gguf
    from hexq.pack.stage import Budget, pack
    from tests.conftest import small_recipe

    model = gguf_model(tmp_path / "model", "mixtral")
    calibrate(model, small_recipe("experts-gguf"), "bundled", tmp_path / "cal")
    pack(tmp_path / "cal", tmp_path / "a.hexq", budget=Budget(avg_bits=4.0))
    import hexq.export.gguf.arch as arch

    monkeypatch.setattr(arch, "FAMILIES", {**arch.FAMILIES, "mixtral": arch.Family("llama", True, False, False)})
    with pytest.raises(HexqError, match="llama.cpp"):
        export_gguf(tmp_path / "a.hexq", tmp_path / "m.gguf", windows=2, seqlen=64)
