"""The LM head quantized by the recipe's `head` section (hexq.calib.head): calibrated after the last layer, packed as
codes, served from them by both decode paths, and the same model in `hexq eval` of the calibration, of the artifact
and `hexq run --ppl`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from hexq.artifact.format import HEAD_WEIGHT
from hexq.artifact.inspect import summarize
from hexq.artifact.reader import Artifact
from hexq.base.data import eval_text, tokenize
from hexq.calib.head import HEAD_ROWS, quantize_rows
from hexq.calib.pipeline import calibrate
from hexq.config.model_check import validate_for_model
from hexq.config.recipe import RecipeError, WeightQuant, recipe_from_dict
from hexq.eval.run import evaluate_model, runtime_divergence, runtime_perplexity
from hexq.pack.stage import Budget, pack
from hexq.packed.weight import dequantize_packed
from hexq.runtime.engine import Runtime
from hexq.runtime.model import artifact_config
from tests.conftest import activation_levels, from_codes, int8_blocks, save_tiny_model, small_recipe

WIDE = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=128, head_dim=16)


@pytest.fixture(scope="module")
def head_artifact(tmp_path_factory):
    """A tied tiny Qwen3-MoE (as the reference models are; top-k renormalised, as llama.cpp's qwen3moe graph needs)
    calibrated with experts-mixed and a 4-bit head in groups of 32 (GPTQ) in place of its 8-bit one; attention W8A8
    as bundled, the head weight-only; packed with every expert at 4 bits, the width the calibration's own model
    computes with (propagate_bits), so that both are one model; (model folder, calibration, artifact)."""
    folder = tmp_path_factory.mktemp("head")
    model = save_tiny_model(folder / "model", "qwen3_moe", tie_word_embeddings=True, norm_topk_prob=True, **WIDE)
    recipe = replace(small_recipe("experts-mixed"), head=WeightQuant(bits=4, group_size=32))
    calibrate(model, recipe, "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", replace(recipe.pack, widths=(4,), avg_bits=4.0), Budget(avg_bits=4))
    return folder / "model", folder / "cal", folder / "model.hexq"


def test_recipe_head_section():
    recipe = recipe_from_dict({"name": "x", "head": {"bits": 6, "group_size": 32, "method": "rtn"}})
    assert recipe.head == WeightQuant(bits=6, group_size=32, method="rtn")
    assert recipe_from_dict({"name": "x"}).head is None  # its fingerprint: tests/test_recipe.py
    with pytest.raises(RecipeError, match="head.bits"):
        recipe_from_dict({"name": "x", "head": {"bits": 9}})
    with pytest.raises(RecipeError, match="head.fit_bits"):
        recipe_from_dict({"name": "x", "head": {"bits": 4, "fit_bits": [3]}})
    grouped = recipe_from_dict({"name": "x", "head": {"bits": 4, "group_size": 128}})
    validate_for_model(grouped, 256, {})
    with pytest.raises(RecipeError, match="head.group_size"):
        validate_for_model(grouped, 192, {})


def test_rows_in_blocks_are_the_whole_matrix(monkeypatch):
    """quantize_rows blocks the rows (GPTQ rows are independent given the factor): the joined blocks are the matrix
    quantized at once, codes, scales and zeros alike."""
    from hexq.calib.capture import SiteStats

    torch.manual_seed(0)
    weight, x = torch.randn(40, 64), torch.randn(200, 64)
    stats = SiteStats.empty(64, torch.device("cpu"))
    stats.add(x)
    setting = WeightQuant(bits=3, group_size=32)
    whole = quantize_rows(weight, stats, setting)
    monkeypatch.setattr("hexq.calib.head.HEAD_ROWS", 16)
    blocked = quantize_rows(weight, stats, setting)
    for a, b in zip((whole.codes, whole.scale, whole.zero), (blocked.codes, blocked.scale, blocked.zero), strict=True):
        assert torch.equal(a, b)
    assert HEAD_ROWS % 8 == 0
    # GPTQ minimises the output error on x: below round-to-nearest's on the same grid
    rtn = quantize_rows(weight, None, replace(setting, method="rtn"))
    error = {name: float((x @ (dequantize_packed(w) - weight).T).norm()) for name, w in (("gptq", whole), ("rtn", rtn))}
    assert error["gptq"] < error["rtn"]


def test_artifact_stores_the_head_as_codes(head_artifact):
    model, _cal, path = head_artifact
    artifact = Artifact(path)
    assert artifact.quantized_linears[HEAD_WEIGHT] == 4
    assert HEAD_WEIGHT not in artifact.aliases
    assert not artifact_config(artifact).tie_word_embeddings  # a head of its own; the embeddings stay as stored
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"]  # the source untouched
    vocab, hidden = 8192, WIDE["hidden_size"]
    assert artifact.packed_param_nbytes(HEAD_WEIGHT) == vocab * hidden // 2 + vocab * hidden // 32 * 4
    head = artifact.read_param(HEAD_WEIGHT, (vocab, hidden))
    embed = artifact.read_param("model.embed_tokens.weight", (vocab, hidden)).float()
    relative = float((head - embed).norm() / embed.norm())
    assert 0 < relative < 0.2  # 4-bit codes of the tied matrix, not the matrix itself
    assert summarize(path)["accounting"]["head"] == "4-bit codes"  # what `hexq inspect` says


def test_every_path_computes_the_same_model(head_artifact):
    """`hexq eval` of the calibration and of the artifact, and `hexq run --ppl` (the transformers path, the head a
    packed linear read a block of rows at a time) give one perplexity, and the artifact and `hexq run` one KL
    divergence from the source model."""
    model, cal, path = head_artifact
    rows = {name: evaluate_model(target, ["austen"], 64, 4, 4, "cpu", kl_against=model)[0]
            for name, target in (("calibration", cal), ("artifact", path))}
    with Runtime(path, dtype="fp32") as runtime:
        text = eval_text("austen")
        ids = tokenize(runtime.tokenizer, text)
        served, _tokens, _seconds = runtime_perplexity(runtime, ids, 64, 4)
        served_kl = runtime_divergence(runtime, text, ids, 64, 4, model).summary()
    ppl = {name: row.result.perplexity for name, row in rows.items()}
    assert abs(ppl["artifact"] / ppl["calibration"] - 1) < 1e-6  # one model, evaluated by one code path
    assert abs(served / ppl["artifact"] - 1) < 1e-3
    kld = rows["artifact"].divergence["kld_mean"]
    assert kld > 0 and abs(served_kl["kld_mean"] / kld - 1) < 1e-2


def test_native_step_reads_the_packed_head(head_artifact):
    """The native step computes the head from its codes like the transformers path (test_native_decode's bound)."""
    from tests.test_native_decode import agrees, compare

    _model, _cal, path = head_artifact
    with Runtime(path, dtype="fp32") as runtime:
        assert type(runtime.model.lm_head).__name__ == "PackedLinear"
    assert agrees(compare(path))


def test_exports_write_the_quantized_head(head_artifact, tmp_path, monkeypatch):
    """compressed-tensors: lm_head.weight is the served head's codes dequantized, in the embeddings' dtype (its
    checkpoints keep the head in full precision); GGUF: output.weight on the block type that holds the codes (4-bit
    groups of 32, asymmetric: Q4_1, exact). Each file passes its export's own check (llama.cpp's logits when
    llama-cpp-python is there), which compares every model through the exported head. Neither the GGUF writer and
    block check nor the compressed-tensors check unpacks more than a block of the head's rows at a time (at
    151,936 x 2048 its float32 copy is 1.2 GB): here blocks of 16 rows."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    import hexq.export.check as ct_check
    import hexq.export.gguf.write as gguf_write
    from hexq.export.command import export_artifact
    from hexq.export.gguf.check import llama_available
    from hexq.export.gguf.command import export_gguf
    from hexq.packed import ggml

    _model, _cal, path = head_artifact
    artifact = Artifact(path)
    config = artifact_config(artifact)
    served = artifact.read_param(HEAD_WEIGHT, (config.vocab_size, config.hidden_size))
    assert config.vocab_size > 2 * WIDE["moe_intermediate_size"]  # no expert matrix has the head's rows
    rows_read = []

    def spy(module, name):
        real = getattr(module, name)

        def counted(weight, *args, **kwargs):
            rows_read.append(weight.shape[0])
            return real(weight, *args, **kwargs)
        monkeypatch.setattr(module, name, counted)

    monkeypatch.setattr(gguf_write, "ROW_ELEMENTS", 16 * config.hidden_size)
    monkeypatch.setattr(ct_check, "HEAD_ROWS", 16)
    for module, name in ((gguf_write, "dequantize_packed"), (gguf_write, "packed_blocks"),
                         (ct_check, "dequantize_packed")):
        spy(module, name)
    whole = ggml.packed_blocks(artifact.packed_param(HEAD_WEIGHT, tuple(served.shape)), False, ggml.Q4_1)
    summary = export_artifact(path, tmp_path / "ct")
    assert summary.check.passed
    index = tmp_path / "ct" / "model.safetensors"
    with safe_open(str(index), framework="pt") as handle:
        exported = handle.get_tensor(HEAD_WEIGHT)
        assert exported.dtype == handle.get_tensor("model.embed_tokens.weight").dtype  # float32 in this test model
    assert torch.equal(exported, served.to(exported.dtype))
    assert not any(HEAD_WEIGHT in name for name in json.loads(
        (tmp_path / "ct" / "config.json").read_text())["quantization_config"].get("config_groups", {}))
    gguf = export_gguf(path, tmp_path / "m.gguf")
    assert gguf.check.passed and gguf.check.engine == ("llama.cpp" if llama_available() else "gguf-py")
    output = next(t for t in GGUFReader(tmp_path / "m.gguf").tensors if t.name == "output.weight")
    assert output.tensor_type == GGMLQuantizationType.Q4_1
    assert torch.equal(torch.from_numpy(output.data.copy()).reshape(whole.shape), whole)  # blocks of rows, one matrix
    # the head 16 rows at a time; every other matrix read has at most an expert's gate_up rows
    assert min(rows_read) <= 16 and max(rows_read) <= 2 * WIDE["moe_intermediate_size"], sorted(set(rows_read))
    written = torch.from_numpy(dequantize(output.data, output.tensor_type).copy()).reshape(served.shape)
    assert (written - served).abs().max() <= 1e-3 * served.abs().max()  # Q4_1's float16 d and m hold s and -z s


def test_served_head_is_weight_only(head_artifact):
    """The served head, from its codes, is its dequantized codes times its input in the GEMV's own activation blocks
    (int8 where the SIMD paths' rows8 GEMV reads it, else int16; emulated here) to float32 rounding: the recipe's
    W8A8 grid on its input would leave ~1e-2 relative, the activation blocks' own rounding ~5e-3 (int8)."""
    _model, _cal, path = head_artifact
    with Runtime(path, dtype="fp32") as runtime:
        head = from_codes(runtime).model.lm_head
        x = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(0))
        if runtime.compute.kernels is not None and activation_levels(runtime.compute.path, head.layout) == 127:
            x_read = int8_blocks(x)
        else:
            x_read = x
        weight = Artifact(path).read_param(HEAD_WEIGHT, (head.out_features, head.in_features)).double()
        want = x_read.double() @ weight.T
        got = head(x).double()
    assert float((got - want).norm() / want.norm()) < 1e-4


def test_memory_plan_counts_the_head_as_codes(head_artifact):
    """`--memory` plans the packed head at its stored bytes (not a bf16 copy, not twice with the embeddings), and the
    plan is what was materialized."""
    from hexq.runtime.model import dense_bytes

    _model, _cal, path = head_artifact
    artifact = Artifact(path)
    with Runtime(path, dtype="bf16", warm="none") as runtime:
        assert runtime.plan.dense_bytes == dense_bytes(runtime.model)
        head = sum(b.numel() * b.element_size() for b in runtime.model.lm_head.buffers())
        assert head == artifact.packed_param_nbytes(HEAD_WEIGHT)  # the head's whole share: its codes, scale, zero
        assert runtime.model.lm_head.codes.data_ptr() != runtime.model.model.embed_tokens.weight.data_ptr()


def test_serving_never_dequantizes_the_whole_head(head_artifact, monkeypatch):
    """Start-up, decode and a perplexity pass read the head as codes (a block of rows at a time): at a real vocabulary
    a float32 copy is 1.2 GB, which once made start-up peak 1.1 GB above the steady state."""
    _model, _cal, path = head_artifact
    read_param = Artifact.read_param

    def guarded(self, name, shape):
        assert name != HEAD_WEIGHT, "the packed head was dequantized whole"
        return read_param(self, name, shape)

    monkeypatch.setattr(Artifact, "read_param", guarded)
    with Runtime(path, dtype="fp32") as runtime:
        runtime.generate("It is a truth universally", 3)
        assert runtime.window_nll(torch.arange(1, 33)) > 0
