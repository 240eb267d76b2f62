"""Each dynamic policy is served as it chose: for every forward pass of `hexq run`, the widths the runtime asks the
cache for are exactly the widths the policy returned for the routed (token, slot) pairs it did not skip, and the
cache serves each at that width or above (a higher resident copy is reused, never a lower one)."""

from __future__ import annotations

import pytest

from hexq.runtime.engine import Runtime


@pytest.fixture(scope="module")
def banked_artifact(wide_calibration, tmp_path_factory):
    """The wide calibration at 2.5 bits with every replica width kept, so that every policy can serve any width."""
    from hexq.config.recipe import Pack
    from hexq.pack.stage import Budget, pack

    out = tmp_path_factory.mktemp("pack") / "wide-banked.hexq"
    pack(wide_calibration, out, Pack(), Budget(avg_bits=2.5), bank=("all",))
    return out


@pytest.mark.parametrize("policy", ["online", "depth", "context"])
def test_the_runtime_serves_the_widths_the_policy_chose(banked_artifact, policy):
    with Runtime(banked_artifact, policy=policy, dtype="fp32") as runtime:
        chosen: list[tuple[int, list[tuple[int, int]]]] = []  # (layer, sorted (expert, width) pairs with width > 0)
        asked: dict[int, list[tuple[int, int]]] = {}
        served: list[tuple[int, int]] = []  # (asked width, served width)
        choose, get = runtime.policy.choose, runtime.cache.get

        def recording_choose(layer, indices, scores, prefill):
            bits = choose(layer, indices, scores, prefill)
            pairs = sorted({(int(e), int(b)) for e, b in zip(indices.reshape(-1).tolist(), bits.reshape(-1).tolist(),
                                                               strict=True) if b > 0})
            chosen.append((layer, pairs))
            asked[len(chosen) - 1] = []
            return bits

        def recording_get(layer, expert, bits, **options):
            weights = get(layer, expert, bits, **options)
            asked[len(chosen) - 1].append((expert, bits))
            served.append((bits, weights.bits))
            return weights

        runtime.policy.choose, runtime.cache.get = recording_choose, recording_get
        runtime.generate("It is a truth universally acknowledged", 8)
    assert len(chosen) >= 8 * 2  # the prefill and 7 decode steps (the 8th token needs none), per MoE layer
    for call, (_layer, pairs) in enumerate(chosen):
        assert sorted(asked[call]) == pairs, (policy, call)
    assert served and all(got >= want for want, got in served)
    assert len({b for _, pairs in chosen for _, b in pairs}) >= 2 or policy == "context"


@pytest.mark.parametrize("policy", ["online", "depth", "context"])
def test_a_policy_bank_holds_every_width_the_policy_asks_for(wide_calibration, tmp_path, policy):
    """`hexq pack --bank POLICY` stores the widths that policy may ask for beside each expert's allocated one, so
    the artifact serves it (a width missing from the bank is a one-line refusal at run time)."""
    import torch

    from hexq.algos.policy_widths import policy_widths
    from hexq.artifact.reader import Artifact
    from hexq.config.recipe import Pack
    from hexq.pack.stage import Budget, pack

    out = tmp_path / f"{policy}.hexq"
    pack(wide_calibration, out, Pack(), Budget(avg_bits=2.5), bank=(policy,))
    artifact = Artifact(out)
    wanted = policy_widths(policy, artifact.allocation, artifact.replica_bits)
    assert wanted and wanted <= set(artifact.bank_bits)
    with Runtime(out, policy=policy, dtype="fp32") as runtime:
        runtime.forward(torch.randint(0, 8192, (1, 48), generator=torch.Generator().manual_seed(0)))
