"""The native decode step (hexq/packed/decode.c through hexq.runtime.native) against the transformers path it stands
in for, on every family it covers, every kernel path this CPU runs, mixed widths and skipped experts.

The bound. Both paths compute every packed matrix with the same kernels from the same int16 activation blocks (the
transformers path is made to compute from the codes too); what differs is float32 rounding order in norms,
attention and softmax (~1e-7 relative per operation), and, where the recipe quantizes activations (W8A8, dynamic per
token), which side of a rounding boundary an activation lands on when those differences meet a near tie: a value
that flips moves by one grid step, 1/255 of its token's range, and a flipped key or value stays in the KV cache. So
each native step starts from the transformers path's KV cache, and a step agrees to rounding order (measured <= 8e-6
relative L2 on the logits on the random models; TYPICAL allows 1e-4) unless a flip happened in it (measured 3.3e-3
in one of 16 steps of the reference Mixtral, carried on; FLIPS allows 2e-2 for any step). A defect moves every step:
the median is held to TYPICAL (dropping the W8A8 grid: ~1.3e-2 each step; a wrong RoPE, router renormalisation,
skipped weight, q/k norm, shared-expert gate or KV position: O(1); scripts/mutants.py runs them). Without activation
quantization no flip can happen: the native step then keeps its own KV cache for every step, each held to 1e-4.
Greedy tokens must agree wherever the transformers path's top two logits are not a near tie.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time

import pytest
import torch

from hexq.artifact.format import expert_shard
from hexq.base.errors import HexqError
from hexq.packed.cpu import available_paths, load_cpu_kernels
from hexq.runtime.compute import Profiles
from hexq.runtime.engine import Runtime
from hexq.runtime.native import AHEAD_RANGES, MAT_ABSENT, NativeDecoder, byte_ranges, top_k_bytes
from tests.conftest import INT16_PATH, REFERENCE_MODELS, activation_levels, needs_kernels, save_tiny_model, small_recipe

KERNELS = load_cpu_kernels()
pytestmark = needs_kernels(KERNELS)
# compare's median step: float32 summation order where the GEMVs read int16 activation blocks. Where this machine's
# default path reads int8 blocks (the SIMD paths' rows8 GEMVs: kernels.c "int8 activation blocks") the two paths'
# inputs, equal to float32 rounding, round to neighbouring int8 values at near ties often enough that the median is a
# flip's size: one int8 step (1/127 of a block's largest) in one input (measured 1.4e-3 to 3.1e-3 on 3 of the
# symmetric g128 artifact's 10 steps). Every step: within FLIPS, where W8A8 grid codes flip too.
TYPICAL = 1e-4 if KERNELS is None or activation_levels(KERNELS.path, "rows8") == 32767 else 5e-3
FLIPS = 2e-2
STEPS = 10
PROMPT = torch.randint(1, 8192, (1, 9), generator=torch.Generator().manual_seed(5))


def compare(artifact, steps: int = STEPS, carry: bool = False, kv_cache: str = "f32") -> list[float]:
    """The relative L2 distance between the native step's logits and the transformers path's at each of `steps` greedy
    steps after PROMPT (both fed the transformers path's tokens). Each native step starts from the transformers
    path's KV cache, so that a W8A8 flip in one step is not carried into the next; with `carry` the native step keeps
    its own cache throughout (held to rounding order where no flip can happen)."""
    errors = []
    with Runtime(artifact, dtype="fp32", kv_cache=kv_cache) as runtime:
        assert runtime.decode_path == "native", runtime.decode_path
        runtime.compute.profiles = Profiles()  # the transformers path from the codes too, whatever the cost model says
        logits, past = runtime._next_logits(PROMPT, None)
        runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + steps)
        token = int(logits.argmax())
        for step in range(steps):
            if not carry:
                runtime.native.start(past, PROMPT.shape[1] + step, PROMPT.shape[1] + steps)
            got = runtime.native.step(token)
            want, past = runtime._next_logits(torch.tensor([[token]]), past)
            errors.append(float((got - want).norm() / want.norm()))
            top2 = want.topk(2).values
            if float(top2[0] - top2[1]) > 1e-2 * float(want.abs().max()):
                assert int(got.argmax()) == int(want.argmax())
            token = int(want.argmax())
    return errors


def agrees(errors: list[float], typical: float = TYPICAL, flips: float = FLIPS) -> bool:
    """The median step within float32 rounding order (`typical`), and every step within `flips`."""
    return statistics.median(errors) <= typical and max(errors) <= flips


def test_native_step_is_the_transformers_step(packed_artifact):
    """Qwen3-MoE, widths 1-4 mixed in every layer, W8A8 attention."""
    assert agrees(compare(packed_artifact))


@pytest.mark.parametrize("path", ["avx2", "avxvnni", "avx512"])
def test_w8a8_attention_on_every_kernel_path(packed_artifact, monkeypatch, path):
    """The W8A8 matrices on each path's own arithmetic: int16 blocks (AVX2), integer sums of 256-bit vpdpbusd
    (AVX-VNNI: w8a8_256.h), of 512-bit ones (AVX-512), each against the transformers step."""
    if path not in available_paths(KERNELS.library):
        pytest.skip(f"this CPU does not run the {path} path")
    monkeypatch.setenv("HEXQ_CPU_PATH", path)
    assert agrees(compare(packed_artifact))


def test_skipped_experts_renormalised_as_served(skipping_artifact):
    """0-bit experts: their routing weight goes to the token's kept experts (hexq.model.simulate.served_weights)."""
    assert agrees(compare(skipping_artifact))


@pytest.fixture(scope="module")
def a16_artifact(tmp_path_factory):
    """The wide Qwen3-MoE of conftest's wide_calibration with activations in full precision everywhere (no W8A8
    grid: the two paths then differ by float32 summation order alone), mixed 2.5 bits."""
    from dataclasses import replace

    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import ActivationQuant, Smoothing
    from hexq.pack.stage import Budget, pack

    folder = tmp_path_factory.mktemp("a16")
    model = save_tiny_model(folder / "model", "qwen3_moe", hidden_size=64, moe_intermediate_size=64,
                            intermediate_size=128, head_dim=16)
    recipe = replace(small_recipe("experts-mixed"), smoothing=Smoothing(method="none"),
                     activations=ActivationQuant(bits=None))
    calibrate(model, recipe, "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", budget=Budget(avg_bits=2.5))
    return folder / "model.hexq"


def test_without_activation_quantization_only_rounding_order_differs(a16_artifact):
    """No W8A8 grid: the two paths agree to float32 summation order through 4 layers (measured 3e-5 on the reference
    Qwen3-MoE; 1e-4 allowed)."""
    assert agrees(compare(a16_artifact, carry=True), flips=1e-4)


def test_float16_kv_cache_within_its_rounding(a16_artifact, monkeypatch):
    """The native step's float16 KV cache (the default; `compare` runs float32): every cached key and value carries a
    relative error of at most u = 2^-11 (binary16, rounded to nearest), a value row's error passes to the attention
    output no larger (a convex combination), a key's moves a score by at most u |q| |k| scaling. Through 4 layers
    and 16 steps, each on its own cache, the logits stay within u of the transformers path's (measured 1.2e-4 to
    2.2e-4 against 3e-5 for float32); a row read at the wrong offset or width moves them by O(1). On the path whose
    GEMVs read int16 activation blocks (the portable one; the SIMD paths' float16 rows: test_every_kernel_path): from
    int8 blocks (kernels.c "int8 activation blocks") a cache rounding that carries an input across a rounding boundary
    of its block moves it by a whole step, 1/127 of the block's largest, which is not the cache's error (measured
    3.7e-4)."""
    monkeypatch.setenv("HEXQ_CPU_PATH", INT16_PATH)
    assert agrees(compare(a16_artifact, steps=16, carry=True, kv_cache="f16"), typical=2.0**-11, flips=2.0**-11)


@pytest.mark.parametrize("path", ["scalar", "avx2", "avxvnni", "avx512"])
def test_every_kernel_path(a16_artifact, path):
    """Every instruction-set path this CPU runs gives the native step the same logits, the KV cache in float16
    (F16C's loads on the AVX2 and AVX-512 paths): paths that read the same activation blocks differ only in float32
    summation order (1e-5 relative); the SIMD paths' rows8 GEMVs read int8 blocks (kernels.c "int8 activation
    blocks"), each input moved by at most 1/254 of its block's largest, and their logits are held to that, 4e-3 of
    the scalar path's (measured 3.4e-4)."""
    if KERNELS is None or path not in available_paths(KERNELS.library):
        pytest.skip(f"this CPU does not run the {path} path")
    logits = {}
    for name in ("scalar", path):
        os.environ["HEXQ_CPU_PATH"] = name
        try:
            with Runtime(a16_artifact, dtype="fp32") as runtime:
                assert runtime.compute.path == name and runtime.decode_path == "native"
                _, past = runtime._next_logits(PROMPT, None)
                runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + 3)
                logits[name] = torch.stack([runtime.native.step(t) for t in (17, 400, 9)])
        finally:
            os.environ.pop("HEXQ_CPU_PATH")
    allowed = 1e-4 if activation_levels(path, "rows8") == activation_levels("scalar", "rows8") else 4e-3
    assert float((logits[path] - logits["scalar"]).norm() / logits["scalar"].norm()) <= allowed


@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
def test_attention_does_not_depend_on_the_thread_count(a16_artifact, monkeypatch, path):
    """The attention's pool items group the query heads of one KV head, fewer heads per item when there are more
    threads (decode.c heads_per_item): each head's arithmetic is the same however many share its item, so the logits
    are the same bits on 1 thread (2 heads per item here) and on 3 (1 head), over 40 positions (past the 8-position
    blocks of scores and the 32-position blocks of values)."""
    if path not in available_paths(KERNELS.library):
        pytest.skip(f"this CPU does not run the {path} path")
    monkeypatch.setenv("HEXQ_CPU_PATH", path)
    tokens = torch.randint(1, 8192, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    with Runtime(a16_artifact, dtype="fp32") as runtime:
        assert runtime.decode_path == "native"
        _, past = runtime._next_logits(PROMPT, None)
        for threads in (1, 3):
            runtime.native.kernels.threads = threads
            runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + len(tokens))
            logits.append(torch.stack([runtime.native.step(token) for token in tokens]))
    assert torch.equal(*logits)


@pytest.fixture(scope="module")
def symmetric_g128_artifact(tmp_path_factory):
    """Experts quantized symmetric in groups of 128 (a Qwen3-MoE 128 wide), widths 1-8 allowed and the allocation
    free to give any of them: the other grid the kernels take."""
    from dataclasses import replace

    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import Pack, WeightQuant
    from hexq.pack.stage import Budget, pack

    folder = tmp_path_factory.mktemp("g128")
    model = save_tiny_model(folder / "model", "qwen3_moe", hidden_size=128, moe_intermediate_size=128,
                            intermediate_size=128, head_dim=32)
    recipe = small_recipe("experts-mixed", weights=WeightQuant(group_size=128, symmetric=True))
    recipe = replace(recipe, pack=Pack(widths=(1, 2, 3, 4, 8), avg_bits=2.5, order="free"))
    calibrate(model, recipe, "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", budget=Budget(avg_bits=2.5))
    return folder / "model.hexq"


def test_symmetric_groups_of_128(symmetric_g128_artifact):
    from hexq.artifact.reader import Artifact

    widths = {b for row in Artifact(symmetric_g128_artifact).allocation for b in row}
    assert len(widths) >= 2, widths
    assert agrees(compare(symmetric_g128_artifact))


@pytest.fixture(scope="module")
def planes_artifact(tmp_path_factory):
    """A Qwen3-MoE 256 wide (8 blocks of 32 per row: whole units of every plane of the planes layout), activations in
    full precision, any width 1-8 free to be allocated."""
    from dataclasses import replace

    from hexq.calib.pipeline import calibrate
    from hexq.config.recipe import ActivationQuant, Pack, Smoothing
    from hexq.pack.stage import Budget, pack

    folder = tmp_path_factory.mktemp("planes")
    model = save_tiny_model(folder / "model", "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
                            intermediate_size=256, head_dim=32)
    widths = (1, 2, 3, 4, 5, 6, 7, 8)
    recipe = replace(small_recipe("experts-mixed", replica_bits=widths), smoothing=Smoothing(method="none"),
                     activations=ActivationQuant(bits=None), pack=Pack(widths=widths, avg_bits=4.0, order="free"))
    calibrate(model, recipe, "bundled", folder / "cal")
    pack(folder / "cal", folder / "model.hexq", budget=Budget(avg_bits=4.0))
    return folder / "model.hexq"


ROWS8_LAYOUTS = {"rows8", "rows8z4"}  # 4-bit zeros for the 3- and 4-bit experts (integer zero points), not 1 and 2


@pytest.mark.parametrize("path, layouts", [("scalar", {"planes"}), ("avx2", ROWS8_LAYOUTS),
                                           ("avxvnni", ROWS8_LAYOUTS), ("avx512", ROWS8_LAYOUTS)])
def test_native_step_on_relaid_codes_is_the_stream_transformers_path(planes_artifact, monkeypatch, path, layouts):
    """The native step re-lays every resident expert and dense matrix into its path's layouts (planes on the portable
    path, rows8 and rows8z4 on the SIMD paths); the transformers path of a runtime without the native step reads the
    stream as stored. With no activation grid both carry their own KV cache and differ by float32 summation order
    only (1e-4 allowed)."""
    from hexq.artifact.reader import Artifact

    if KERNELS is None or path not in available_paths(KERNELS.library):
        pytest.skip(f"this CPU does not run the {path} path")
    monkeypatch.setenv("HEXQ_CPU_PATH", path)
    widths = {b for row in Artifact(planes_artifact).allocation for b in row}
    assert len(widths - {8}) >= 3, widths
    tokens = [int(t) for t in torch.randint(1, 8192, (8,), generator=torch.Generator().manual_seed(2))]
    logits = {}
    for decode in ("native", "transformers"):
        with Runtime(planes_artifact, dtype="fp32", decode=decode, kv_cache="f32") as runtime:
            runtime.compute.profiles = Profiles()  # from the codes
            seen = {runtime.cache.get(layer, expert, 1).gate_up.layout for layer, expert in runtime.cache.resident()
                    if runtime.cache.get(layer, expert, 1).gate_up.bits < 8}
            assert seen == (layouts if decode == "native" else {"stream"}), seen
            _, past = runtime._next_logits(PROMPT, None)
            if decode == "native":
                runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + len(tokens))
                logits[decode] = torch.stack([runtime.native.step(t) for t in tokens])
            else:
                steps = []
                for t in tokens:
                    step, past = runtime._next_logits(torch.tensor([[t]]), past)
                    steps.append(step)
                logits[decode] = torch.stack(steps)
    errors = ((logits["native"] - logits["transformers"]).norm(dim=-1) / logits["transformers"].norm(dim=-1))
    assert float(errors.max()) <= 1e-4, errors


# Families at widths the kernels take (multiples of 32): qwen2_moe with a dense first layer, a shared expert and its
# gate, q/k/v biases; olmoe with q/k norms over the whole projection; mixtral.
def test_every_family(family_artifact):
    assert agrees(compare(family_artifact))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFERENCE_MODELS))
def test_reference_models(name, tmp_path):
    """The trained reference models, mixed 2.5 bits."""
    from hexq.calib.pipeline import calibrate
    from hexq.pack.stage import Budget, pack

    calibrate(REFERENCE_MODELS[name], small_recipe("experts-mixed"), "bundled", tmp_path / "cal")
    pack(tmp_path / "cal", tmp_path / "model.hexq", budget=Budget(avg_bits=2.5))
    assert agrees(compare(tmp_path / "model.hexq", steps=16))


def native_run(artifact, steps: int, **options) -> tuple[list[torch.Tensor], Runtime, dict[str, float]]:
    """The native step's logits for `steps` greedy tokens after PROMPT, every step from its own KV cache, the prompt
    prefilled by the transformers path of a runtime with every expert resident (the same KV cache for every run); the
    runtime, and the step's profile over those tokens."""
    with Runtime(artifact, dtype="fp32") as full:
        logits, past = full._next_logits(PROMPT, None)
    out = []
    with Runtime(artifact, dtype="fp32", **options) as runtime:
        assert runtime.decode_path == "native", runtime.decode_path
        runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + steps)
        runtime.cache.reset_stats()
        runtime.native.profile()  # counted from here
        token = int(logits.argmax())
        for _ in range(steps):
            out.append(runtime.native.step(token))
            token = int(out[-1].argmax())
        return out, runtime, runtime.native.profile()


def test_native_step_under_a_small_fast_tier_loads_its_misses(packed_artifact):
    """A fast tier holding one layer's top-k experts: the native step stops at each layer whose kept experts are
    not all resident, they are loaded through the cache (evicting others, whose table entries must become absent),
    and it goes on: the logits are the ones with every expert resident, bit for bit (the same codes, re-laid the
    same way, the same arithmetic). The cache's counts see every routed expert: each kept one is a hit or a miss,
    and the step reads only the misses (what the cache held at the start is served from its tables). At the
    smallest tier whether an expert is still there when it comes back depends on the routing, so hits are checked
    under a tier one byte short of every expert (8 experts per layer, 12 steps x top-2: some come back)."""
    steps = 12
    want, _, _ = native_run(packed_artifact, steps)
    with Runtime(packed_artifact, dtype="fp32") as probe:
        smallest = top_k_bytes(probe)  # the least the native step takes: the most churn
        assert smallest < probe.plan.expert_bytes
        top_k, moe_layers = probe.model.config.num_experts_per_tok, len(probe.artifact.moe_layers)
        budgets = (smallest, probe.plan.expert_bytes - 1)
    routed = steps * top_k * moe_layers  # no 0-bit expert in this artifact
    for budget in budgets:
        got, runtime, profile = native_run(packed_artifact, steps, fast_tier_bytes=budget)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        stats = runtime.cache.stats
        assert stats.misses > 0 and stats.evictions > 0 and stats.hits + stats.misses == routed, (budget, stats)
        # the step stops only for experts that must be read: those resident from the start (the warm start's) and
        # since are served from its tables, so each expert it reads is a miss of the cache
        assert round(profile["missed"] * steps) == stats.misses, (budget, profile, stats)
        assert runtime.cache.fast_tier.peak <= budget
        assert budget == smallest or stats.hits > 0


def cached_share(path, ranges) -> float:
    """The share of the pages of byte `ranges` ((offset, length) pairs) of file `path` in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    resident = total = 0
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        view = (ctypes.c_char * len(mapped)).from_buffer(mapped)
        try:
            for offset, length in ranges:
                first = offset // page * page
                count = (offset + length - first + page - 1) // page
                vector = (ctypes.c_ubyte * count)()
                assert libc.mincore(ctypes.c_void_p(ctypes.addressof(view) + first), count * page, vector) == 0
                resident += sum(byte & 1 for byte in vector)
                total += count
        finally:
            del view
    return resident / total


def test_byte_ranges_merge_adjacent_spans_and_cover_the_rest():
    span = type("Span", (), {"__init__": lambda self, start, end: self.__dict__.update(start=start, end=end)})
    spans = [span(100, 200), span(0, 50), span(50, 60), span(200, 210), span(300, 310), span(400, 410)]
    assert byte_ranges(spans, 4) == [(0, 60), (100, 110), (300, 10), (400, 10)]
    assert byte_ranges(spans, 2) == [(0, 60), (100, 310)]


def test_native_step_reads_its_misses_ahead(packed_artifact, monkeypatch):
    """Under a fast tier smaller than the experts the step asks the kernel to read every absent expert a routing
    keeps (and the next layer's predicted ones) into the page cache before returning to Python, so the loads Python
    then makes wait for one read, not one after another: with the artifact's expert pages dropped from the page
    cache, each missing expert's bytes are cached (or arriving) before Python has read any of them. Each expert's
    ranges cover exactly its stored replica, and the profile counts every miss as read ahead."""
    with Runtime(packed_artifact, dtype="fp32") as probe:
        budget = top_k_bytes(probe)
    steps, seen = 4, []
    original = NativeDecoder._load_absent

    def checked(self):
        artifact, row = self.runtime.artifact, self._rows[self.resume.layer]
        table = self._tables[row][0]
        for expert in self.resume.ids[:self.resume.n]:
            if table[expert].gate_up.kind != MAT_ABSENT:
                continue
            spans = artifact.expert_spans(row, expert, artifact.allocation[row][expert])
            ranges = byte_ranges(spans, AHEAD_RANGES)
            assert sum(length for _, length in ranges) == sum(s.end - s.start for s in spans)
            path = artifact.path / expert_shard(artifact.moe_layers[row])
            # the kernel's read is asynchronous; a correct step has it done in ms (no second wait after a failure)
            deadline = time.monotonic() + (5 if min(seen, default=1.0) == 1.0 else 0)
            while cached_share(path, ranges) < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append(cached_share(path, ranges))
        return original(self)

    with Runtime(packed_artifact, dtype="fp32") as full:
        logits, past = full._next_logits(PROMPT, None)
    with Runtime(packed_artifact, dtype="fp32", fast_tier_bytes=budget) as runtime:
        runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + steps)
        runtime.native.profile()  # counted from here
        runtime.cache.reset_stats()
        monkeypatch.setattr(NativeDecoder, "_load_absent", checked)
        shards = sorted((packed_artifact / "experts").glob("*.safetensors"))
        assert shards
        token = int(logits.argmax())
        for _ in range(steps):
            for shard in shards:  # clean pages: dropped, so only a read brings them back
                fd = os.open(shard, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            if cached_share(shards[0], [(0, shards[0].stat().st_size)]) > 0.5:
                pytest.skip(f"{shards[0].parent}: its file system keeps its pages (tmpfs?), so a read shows nothing")
            token = int(runtime.native.step(token).argmax())
        profile = runtime.native.profile()
        misses = runtime.cache.stats.misses
    assert seen and min(seen) == 1.0
    assert misses > 0 and round(profile["missed"] * steps) == misses
    assert profile["predicted"] > 0 and 0 <= profile["ahead_precision"] <= 1


def test_generate_uses_the_native_step_and_says_why_not(packed_artifact):
    """`hexq run --prompt` decodes natively where it can, with the same greedy text as the transformers path (the
    KV cache in float32: float16's rounding flips this random model's near ties), and names the reason where it
    cannot; --decode native refuses what it does not cover."""
    texts = {}
    for decode in ("auto", "transformers"):
        with Runtime(packed_artifact, dtype="fp32", decode=decode, kv_cache="f32") as runtime:
            texts[decode], stats = runtime.generate("It is a truth universally acknowledged", 12)
            assert stats.decode_path == ("native" if decode == "auto" else "transformers (--decode transformers)")
            below = top_k_bytes(runtime) - 1  # room for one expert, not for a layer's top-k
    assert texts["auto"] == texts["transformers"]
    with Runtime(packed_artifact, cache="bf16") as runtime:
        assert runtime.decode_path.startswith("transformers (--cache bf16")
    with pytest.raises(HexqError, match="--decode native: the fast tier holds fewer than"):
        Runtime(packed_artifact, fast_tier_bytes=below, decode="native")
