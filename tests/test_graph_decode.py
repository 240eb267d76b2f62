"""The CUDA graph decode step (hexq.runtime.graph) against the transformers path it stands in for, on every family
it covers: on CUDA where there is one (captured and replayed), else eagerly in Triton's CPU interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py), which checks the step's math and that it could be captured, not its
speed.

The bound is the native step's (tests/test_native_decode.py): both paths compute every packed matrix with the same
Triton kernel from the same activations - a fused q/k/v matrix sums each row in the same order as the separate ones,
so fusing changes no bit - and differ by float32 rounding order in norms, RoPE, attention over the masked static
cache and softmax (~1e-7 relative per operation); where W8A8 puts an activation on a rounding boundary, that order
can flip it by one grid step. Each step therefore starts from the transformers path's KV cache and the median step
is held to TYPICAL (measured <= 2.3e-7 in the interpreter), every step to FLIPS; a defect (a wrong position, mask,
RoPE, norm, routing weight or gate) moves every step by far more.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hexq.model.simulate import ActQuantizer
from hexq.packed import triton as gpu
from hexq.runtime.engine import Runtime
from hexq.runtime.graph import GraphDecoder
from tests.test_native_decode import FLIPS, PROMPT, agrees

pytestmark = pytest.mark.skipif(not gpu.available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = 6
TYPICAL = 1e-5  # measured <= 2.3e-7 on the CPU (the same Triton kernel on both paths)
GENERATED = 4  # tokens generated where a test compares texts (compare() checks the logits step by step)


def compare(artifact, steps: int = STEPS) -> list[float]:
    """Relative L2 distance of the step's logits from the transformers path's at each of `steps` greedy steps after
    PROMPT, each step started from the transformers path's KV cache."""
    errors = []
    with Runtime(artifact, device=DEVICE, kernels="triton", dtype="fp32") as runtime:
        assert isinstance(runtime.native, GraphDecoder), runtime.decode_path
        logits, past = runtime._next_logits(PROMPT, None)
        token = int(logits.argmax())
        for step in range(steps):
            runtime.native.start(past, PROMPT.shape[1] + step, PROMPT.shape[1] + steps)
            got = runtime.native.step(token).cpu()
            want, past = runtime._next_logits(torch.tensor([[token]]), past)
            want = want.cpu()
            errors.append(float((got - want).norm() / want.norm()))
            token = int(want.argmax())
    return errors


def test_graph_step_is_the_transformers_step(packed_artifact):
    """Qwen3-MoE, widths 1-4 mixed in every layer, W8A8 attention (q/k/v fused into one matrix)."""
    assert agrees(compare(packed_artifact), TYPICAL, FLIPS)


def test_skipped_experts_renormalised_as_served(skipping_artifact):
    assert agrees(compare(skipping_artifact), TYPICAL, FLIPS)


def test_every_family(family_artifact):
    assert agrees(compare(family_artifact), TYPICAL, FLIPS)


def test_q_k_v_are_one_matrix_whose_views_the_modules_read(packed_artifact):
    """The fused matrix is the modules' own bytes: q/k/v's codes are views into it (nothing stored twice), and the
    fused product is the three products end to end, bit for bit."""
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32") as runtime:
        layer = runtime.native.layers[0]
        (fused,) = layer.qkv.linears
        attn = runtime.model.model.layers[0].self_attn
        assert all(m.codes.untyped_storage().data_ptr() == fused.weight.codes.untyped_storage().data_ptr()
                   for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        x = torch.randn(1, attn.q_proj.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        separate = torch.cat([m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)
        assert torch.equal(torch.cat(layer.qkv(x), dim=-1), separate.float())


class HostReads(TorchDispatchMode):
    """Fails on any operator that reads a device value on the host or copies host data in: what a CUDA graph capture
    refuses (a synchronisation, or a data-dependent shape)."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "lift_fresh", "item",
               "is_nonzero", "equal"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING:
            raise AssertionError(f"the step calls {func} (a host read: a CUDA graph cannot capture it)")
        return func(*args, **(kwargs or {}))


def test_the_step_reads_nothing_on_the_host(packed_artifact, skipping_artifact):
    """The step's torch operators, checked on any machine: none reads a device value on the host (.item(), a
    boolean index, a nonzero) or makes a tensor from host data, so the capture on CUDA cannot fail on one."""
    for artifact in (packed_artifact, skipping_artifact):
        with Runtime(artifact, device=DEVICE, kernels="triton", dtype="fp32") as runtime:
            logits, past = runtime._next_logits(PROMPT, None)
            runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + 2)
            runtime.native.token.fill_(int(logits.argmax()))
            with HostReads():
                runtime.native._forward()


VIEWS = {"view", "_unsafe_view", "reshape", "expand", "transpose", "t", "slice", "select", "split", "split_with_sizes",
         "unsqueeze", "squeeze", "alias", "detach", "as_strided"}


class Operators(TorchDispatchMode):
    """Counts the torch operators a step runs (views apart) and its Triton GEMV launches, each launch as one (the
    interpreter's own tensor copies inside it not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in VIEWS:
            self.views += 1
        else:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_step_is_a_bounded_number_of_operators(packed_artifact, monkeypatch):
    """What a CUDA graph of the step replays: ~100 operators per layer (202 and 82 views on this 2-layer model; 396
    and 160 on the 4-layer reference Qwen3-MoE), against ~3,400 operator calls of the transformers decoder on the
    latter (docs/gpu.md). Held under 130 per layer, so that a loop over experts or heads put into the step fails."""
    from torch.utils._python_dispatch import _disable_current_modes

    launch, counter = gpu._pair_gemv, Operators()

    class Counted:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                counter.count += 1
                with _disable_current_modes():
                    return launch[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(gpu, "_pair_gemv", Counted())
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32") as runtime:
        _, past = runtime._next_logits(PROMPT, None)
        runtime.native.start(past, PROMPT.shape[1], PROMPT.shape[1] + 2)
        counter.count = 0  # the launches of the build and the prefill
        with counter:
            runtime.native._forward()
        layers = len(runtime.native.layers)
    print(f"{counter.count} operators and {counter.views} views per step, {layers} layers")
    assert counter.count <= 130 * layers


def test_static_activation_grids_are_made_on_the_device():
    """A static (calibrated) activation range is made by fill kernels, not copied from host memory: no bundled
    recipe uses one, so it is checked here on its own."""
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    with HostReads():
        ActQuantizer(8, False, False, -1.0, 2.0)(x)


def test_the_check_catches_a_host_read():
    with pytest.raises(AssertionError, match="host read"), HostReads():
        torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="host read"), HostReads():
        torch.tensor([[-1.0, 2.0]])


def test_generate_takes_the_step_and_gives_the_transformers_text(packed_artifact):
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32") as runtime:
        text, stats = runtime.generate("It is a truth", GENERATED)
        assert stats.decode_path == ("cuda graph" if DEVICE == "cuda" else "static step (eager off CUDA)")
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32", decode="transformers") as runtime:
        want, _ = runtime.generate("It is a truth", GENERATED)
    assert text == want


def test_the_kv_cache_grows_by_powers_of_two_within_the_planned_context(packed_artifact):
    """Each growth reallocates the cache and captures anew: requests of growing length take a few, not one each."""
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32", context=120) as runtime:
        step = runtime.native
        _, past = runtime._next_logits(PROMPT, None)
        sizes = []
        for capacity in (12, 50, 70, 65, 119):
            step.start(past, PROMPT.shape[1], capacity)
            sizes.append(step.capacity)
        assert sizes == [64, 64, 120, 120, 120]


def test_a_refused_capture_falls_back_to_the_eager_step(packed_artifact, monkeypatch):
    """A capture the driver refuses is named in --stats and the same step runs eagerly: the same text."""
    def refused(self):
        raise RuntimeError("operation not permitted when stream is capturing\n(details)")

    monkeypatch.setattr(GraphDecoder, "_capture", refused)
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32") as runtime:
        runtime.native.captures = True  # as on CUDA
        text, stats = runtime.generate("It is a truth", GENERATED)
    assert stats.decode_path == "static step (the CUDA graph capture failed: operation not permitted when stream is " \
                                "capturing)"
    with Runtime(packed_artifact, device=DEVICE, kernels="triton", dtype="fp32", decode="transformers") as runtime:
        want, _ = runtime.generate("It is a truth", GENERATED)
    assert text == want


# Only where CUDA is (defined there alone, so that a CPU-only run reports no skip; scripts/gpu_check.sh runs it)
if torch.cuda.is_available():

    @pytest.mark.gpu
    def test_replay_is_the_eager_step_and_never_synchronises(packed_artifact):
        """On CUDA: the captured graph replays the eager step's kernels (the same logits bit for bit) with no host
        synchronisation inside."""
        with Runtime(packed_artifact, device="cuda", kernels="triton", dtype="fp32") as runtime:
            step = runtime.native
            logits, past = runtime._next_logits(PROMPT, None)
            token = int(logits.argmax())
            step.start(past, PROMPT.shape[1], PROMPT.shape[1] + 2)
            step.step(token)  # captured here
            step.start(past, PROMPT.shape[1], PROMPT.shape[1] + 2)
            step.token.fill_(token)
            step.position.fill_(PROMPT.shape[1])
            step._forward()
            eager = step.logits.clone()
            step.start(past, PROMPT.shape[1], PROMPT.shape[1] + 2)
            torch.cuda.set_sync_debug_mode("error")
            try:
                replayed = step.step(token)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert step.graph is not None and torch.equal(replayed, eager)
