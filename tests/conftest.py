"""Shared fixtures: tiny random MoE checkpoints of every supported family, saved as real model folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton's kernels run in its CPU interpreter (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
# Under CI=true (.ci/run) a tool the project builds or installs must be there: its tests fail instead of skipping.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session", autouse=True)
def own_cache_folder(tmp_path_factory):
    """hexq's cache folder for this test session alone: latencies the cost model measured in an earlier run
    (profiles/ of the user's folder) must not decide which path a test takes. The kernel library already built for
    these sources is copied over, so no test process compiles it again."""
    import shutil

    from hexq.base.io import cache_dir
    from hexq.packed import cpu

    folder = tmp_path_factory.mktemp("hexq-cache")
    compiler = cpu._compiler()
    built = cpu.library_path(compiler) if compiler else None
    if built is not None and built.is_file():
        (folder / "kernels").mkdir()
        shutil.copy2(built, folder / "kernels" / built.name)
    assert cache_dir() != folder
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HEXQ_CACHE_DIR", str(folder))
        yield folder


def needs_kernels(kernels) -> pytest.MarkDecorator:
    """Skip a test that needs the CPU kernels where they did not build, except in CI, where it runs and fails
    (tests/test_packed_cpu.py's test_kernels_build says what is missing in one line)."""
    return pytest.mark.skipif(kernels is None and not IN_CI, reason="no C compiler: the CPU kernels cannot be built "
                              "here")

def activation_levels(path: str, layout: str) -> int:
    """The largest integer of the activation blocks a GEMV of codes in `layout` reads on CPU path `path` (each block's
    step is its max|x| over it): 127, int8 blocks, for the rows8 layouts on the paths that read them at speed
    (hexq.packed.cpu.ROWS8_PATHS; kernels.c "int8 activation blocks"), else 32767, int16 blocks."""
    from hexq.packed.cpu import ROWS8_PATHS

    return 127 if path in ROWS8_PATHS and layout in ("rows8", "rows8z4") else 32767


# The path whose GEMVs all read int16 activation blocks (activation_levels): the portable one.
INT16_PATH = "scalar"


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [n, cols] as the int8 activation blocks hold it (kernels.c "int8 activation blocks"): each block of 32 on
    the integers times max|x| / 127, in float32 as quantize_x computes them."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127)
    return (q * (amax / 127)).view_as(x)


def from_codes(runtime):
    """The runtime with every matrix the kernels take computed from its codes, whatever the machine's measured cost
    model would pick (on tiny matrices it may expand them: one call's overhead outweighs the bytes, and expanded
    codes give the same numbers in any layout)."""
    from hexq.runtime.compute import Profiles

    runtime.compute.profiles = Profiles()
    return runtime


# Every device this machine has: tests that compare numbers across devices run on each (the GPU ones only where
# CUDA is present; scripts/gpu_check.sh runs them there).
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()
TOKENIZER_DIR = ROOT / "models" / "tokenizer"
REFERENCE_MODELS = {
    "mixtral": ROOT / "models" / "hexq-tiny-mixtral",
    "qwen3moe": ROOT / "models" / "hexq-tiny-qwen3moe",
}

# Smallest configs that still exercise each family's MoE block (shared experts, dense first layers, ...).
TINY_CONFIGS = {
    "mixtral": dict(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                      num_experts=8, num_experts_per_tok=2),
    "olmoe": dict(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
                  num_experts=8, num_experts_per_tok=2),
    "deepseek_v2": dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_attention_heads=4,
                        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1),
    "deepseek_v3": dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_attention_heads=4,
                        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1),
    "phimoe": dict(hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
                   num_local_experts=4, num_experts_per_tok=2),
}


def build_tiny_model(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=8192, num_hidden_layers=2, max_position_embeddings=128) | TINY_CONFIGS[model_type]
    config = AutoConfig.for_model(model_type, **(kwargs | overrides))
    return AutoModelForCausalLM.from_config(config).eval()


def save_tiny_model(folder: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoTokenizer

    build_tiny_model(model_type, seed, **overrides).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3moe(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def small_recipe(name: str, **experts):
    """A bundled recipe on 6 windows of 32 tokens (seconds on CPU), optionally with experts fields replaced."""
    from dataclasses import replace

    from hexq.config.recipe import Calibration
    from hexq.config.recipe_files import load_recipe

    recipe = replace(load_recipe(name), calibration=Calibration(num_samples=6, seqlen=32, seed=0))
    return replace(recipe, experts=replace(recipe.experts, **experts)) if experts else recipe


def mixed_recipe():
    """experts-mixed with groups of 16 (the tiny models' expert width is 16), packed by 002's prefix split over 1-4
    bits (pack.order free and 0-bit experts have tests of their own)."""
    from dataclasses import replace

    from hexq.config.recipe import Pack, WeightQuant

    return replace(small_recipe("experts-mixed", weights=WeightQuant(group_size=16, symmetric=False)), pack=Pack())


@pytest.fixture(scope="session")
def mixed_calibration(tiny_qwen3moe, tmp_path_factory):
    """(folder, summary) of an experts-mixed calibration of the tiny Qwen3-MoE, shared by calibrate and pack tests."""
    from hexq.calib.pipeline import calibrate

    out = tmp_path_factory.mktemp("cal") / "mixed"
    return out, calibrate(tiny_qwen3moe, mixed_recipe(), "bundled", out)


@pytest.fixture(scope="session")
def mixed_artifact(mixed_calibration, tmp_path_factory):
    """The tiny calibration packed at 2.5 bits on average (widths 1-4 mixed in every layer)."""
    from hexq.pack.stage import Budget, pack

    out = tmp_path_factory.mktemp("pack") / "mixed-2.5.hexq"
    pack(mixed_calibration[0], out, budget=Budget(avg_bits=2.5))
    return out


@pytest.fixture(scope="session")
def wide_calibration(tmp_path_factory):
    """A tiny Qwen3-MoE wide enough for the packed kernels (hidden and expert width 64: groups of 32, whole 64-code
    steps), calibrated with experts-mixed (groups of 32) with the experts' columns in natural order.

    Natural order because test_decode_from_the_codes_tracks_the_exact_model compares logits step by step: with the
    bundled act_order one decode step of this random model lands on a near tie (a router's top-k or a W8A8
    rounding) that the exact and the from-the-codes paths break differently, 1.5e-3 to 3.4e-3 apart where every
    other step is ~2e-5.

    One Hessian for every width (experts.down_fit full_precision) because skipping_artifact needs skipped experts:
    with the down projection fitted to each replica's own intermediate, this random model's 1-bit replicas lose
    ~1/20 of what they lose without it (not over-fitting: the same with 8x the windows), less than skipping any
    expert, and no allocation of 1 bit or more skips one."""
    from dataclasses import replace

    from hexq.calib.pipeline import calibrate

    model = save_tiny_model(tmp_path_factory.mktemp("wide-qwen3moe"), "qwen3_moe", hidden_size=64,
                            moe_intermediate_size=64, intermediate_size=128, head_dim=16)
    calibration = tmp_path_factory.mktemp("cal") / "wide"
    recipe = small_recipe("experts-mixed")
    weights = replace(recipe.experts.weights, act_order="none")
    experts = replace(recipe.experts, weights=weights, down_fit="full_precision")
    calibrate(model, replace(recipe, experts=experts), "bundled", calibration)
    return calibration


@pytest.fixture(scope="session")
def packed_artifact(wide_calibration, tmp_path_factory):
    """The wide calibration packed at 2.5 bits by 002's prefix split over 1-4 bits (widths mixed, no expert
    skipped)."""
    from hexq.config.recipe import Pack
    from hexq.pack.stage import Budget, pack

    out = tmp_path_factory.mktemp("pack") / "wide-2.5.hexq"
    pack(wide_calibration, out, Pack(), Budget(avg_bits=2.5))
    return out


@pytest.fixture(scope="session")
def skipping_artifact(wide_calibration, tmp_path_factory):
    """The wide calibration packed at 1.5 bits by the bundled recipe's allocator (0-8 bits, any width per expert):
    some experts of every layer skipped (0 bits)."""
    from hexq.pack.stage import Budget, pack

    out = tmp_path_factory.mktemp("pack") / "wide-1.5.hexq"
    pack(wide_calibration, out, budget=Budget(avg_bits=1.5))
    return out


class HexqFactoriesOnMeta:
    """A torch function mode: every tensor factory (torch.zeros, torch.tensor, torch.arange, ...) called from hexq's
    own code without an explicit device creates its tensor on the meta device, as `torch.set_default_device("meta")`
    would, while third-party code (tokenizers, transformers) keeps the CPU default. A hexq tensor created without
    the device of the data it joins then fails loudly when it meets that data - the bug that crashes a CUDA run,
    caught on a machine without a GPU. Because copying a meta tensor into a real one is a silent no-op, every such
    call is also recorded, and leaving the block fails if there was any."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._device import _device_constructors

        # torch.asarray is left out: safetensors' get_slice calls it from native code on behalf of the reader (with
        # no Python frame of its own), so it would look like a hexq call; hexq builds tensors with torch.tensor.
        constructors = _device_constructors() - {torch.asarray}
        self.calls: list[str] = []
        calls = self.calls

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in constructors and kwargs.get("device") is None:
                    where = _hexq_caller()
                    if where is not None:
                        kwargs["device"] = "meta"
                        calls.append(f"{getattr(func, '__name__', func)} at {where}")
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, exc_type, *exc):
        self.mode.__exit__(exc_type, *exc)
        if exc_type is None:
            assert not self.calls, f"tensors created without an explicit device: {sorted(set(self.calls))}"
        return False


def _hexq_caller() -> str | None:
    """module:line of the first non-torch frame calling a tensor factory, if that frame is hexq's."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("torch"):
            if module == "hexq" or module.startswith("hexq."):
                return f"{module}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


# The families the native and CUDA graph decode steps cover beside qwen3_moe (packed_artifact), tiny, mixed 2.5 bits.
DECODE_FAMILIES = {
    "qwen2_moe": dict(hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                      intermediate_size=128, head_dim=16, mlp_only_layers=[0]),
    "olmoe": dict(hidden_size=64, intermediate_size=64),
    "mixtral": dict(hidden_size=64, intermediate_size=64),
}


@pytest.fixture(scope="session", params=sorted(DECODE_FAMILIES))
def family_artifact(request, tmp_path_factory):
    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import Budget, pack

    folder = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(folder / "model", request.param, **DECODE_FAMILIES[request.param])
    calibrate(model, small_recipe("experts-mixed"), "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", budget=Budget(avg_bits=2.5))
    return folder / "model.hexq"
