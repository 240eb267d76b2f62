"""Every tensor hexq creates joins the device of its data: calibrate, pack, eval and run are run with hexq's own
tensor factories sent to the meta device (tests.conftest.HexqFactoriesOnMeta), so a tensor created without an
explicit device fails loudly, as it would on a GPU - checked on a machine without one."""

import pytest
import torch

from hexq.base.data import eval_text, tokenize
from hexq.calib.pipeline import calibrate
from hexq.eval.run import evaluate_model, runtime_perplexity
from hexq.pack.stage import Budget, pack
from hexq.runtime.engine import Runtime
from tests.conftest import HexqFactoriesOnMeta, mixed_recipe, small_recipe


def test_the_harness_catches_a_device_less_tensor():
    from hexq.algos.quant import QuantSpec, quantize

    with pytest.raises(AssertionError, match=r"without an explicit device: \['zeros at hexq.fake:3'\]"):
        with HexqFactoriesOnMeta():
            made = _device_less_zeros()  # hexq code creating a tensor without a device: it lands on meta
            assert made.device.type == "meta"
            with pytest.raises((NotImplementedError, RuntimeError)):  # and fails when it meets CPU data
                torch.zeros(3, device="cpu") + made
    w = torch.randn(4, 8)
    with HexqFactoriesOnMeta():  # pure hexq math on CPU data still works: its tensors follow their inputs
        codes, meta = quantize(w, QuantSpec(bits=4))
    assert codes.device.type == "cpu" and meta.scale.device.type == "cpu"


def _device_less_zeros():
    import types

    module = types.ModuleType("hexq.fake")  # a frame whose module is hexq's
    exec("import torch\ndef make():\n    return torch.zeros(3)\n", module.__dict__)
    return module.make()


def test_calibrate_pack_eval_run_create_every_tensor_on_its_data_s_device(tiny_qwen3moe, tmp_path):
    with HexqFactoriesOnMeta():
        calibrate(tiny_qwen3moe, small_recipe("haq-w8a8"), "bundled", tmp_path / "haq", device="cpu")
        calibrate(tiny_qwen3moe, mixed_recipe(), "bundled", tmp_path / "mixed", device="cpu")
        artifact = pack(tmp_path / "mixed", tmp_path / "a.hexq", budget=Budget(avg_bits=2.5), bank=("all",)).out
        for target in (tiny_qwen3moe, tmp_path / "haq", artifact):
            (row,) = evaluate_model(target, ["austen"], 32, 2, 2, device="cpu")
            assert row.result.perplexity > 1
        for policy in ("static", "context", "online", "depth"):
            with Runtime(artifact, fast_tier_bytes=20_000, policy=policy, device="cpu") as runtime:
                ids = tokenize(runtime.tokenizer, eval_text("austen"))
                assert runtime_perplexity(runtime, ids, 32, 2)[0] > 1
                runtime.generate("It is a truth", 3)
