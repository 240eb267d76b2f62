"""Fill-or-bypass cost model (003 §III.C.1, eq. 7-8) on injected latencies and a fake clock."""

from __future__ import annotations

import math

import pytest
import torch

from hexq.runtime.cost import LatencyProfile, measure_latency, n_critical, should_fill


def brute_force_fill(n: int, p: LatencyProfile) -> bool:
    return n * p.lat_slow_per_token > p.fill_seconds + n * p.lat_fast_per_token


def test_n_critical_matches_eq_7_8():
    p = LatencyProfile(lat_slow_per_token=3e-3, lat_fast_per_token=1e-3, fill_seconds=20e-3)
    assert n_critical(p) == pytest.approx(10.0)  # T_e / (lat_slow - lat_fast) = 20 ms / 2 ms
    assert not should_fill(1, p)  # decode: 3 ms slow vs 21 ms fill
    assert not should_fill(10, p)  # tie at n_critical keeps the slow path
    assert should_fill(11, p)
    assert should_fill(512, p)  # prefill


@pytest.mark.parametrize("slow,fast,fill", [(2e-3, 5e-4, 7e-3), (1e-4, 1e-4, 1e-3), (1e-5, 2e-3, 0.0),
                                            (4e-3, 0.0, 0.0), (1.0, 0.5, 3.3)])
def test_should_fill_agrees_with_brute_force_and_n_critical(slow, fast, fill):
    p = LatencyProfile(slow, fast, fill)
    nc = n_critical(p)
    for n in range(0, 200):
        assert should_fill(n, p) == brute_force_fill(n, p)
        if not math.isclose(n, nc):
            assert should_fill(n, p) == (n > nc)


def test_fast_path_no_faster_never_fills():
    p = LatencyProfile(lat_slow_per_token=1e-3, lat_fast_per_token=2e-3, fill_seconds=0.0)
    assert n_critical(p) == math.inf
    assert not any(should_fill(n, p) for n in (1, 100, 10**6))


def test_invalid_profile_and_tokens():
    with pytest.raises(ValueError, match="fill_seconds"):
        LatencyProfile(1e-3, 1e-4, -1.0)
    with pytest.raises(ValueError, match="lat_slow_per_token"):
        LatencyProfile(math.nan, 1e-4, 0.0)
    with pytest.raises(ValueError, match="n_tokens"):
        should_fill(-1, LatencyProfile(1e-3, 1e-4, 0.0))


class FakeClock:
    """Time advances only when a timed callable says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_measure_latency_with_injected_clock():
    clock = FakeClock()
    calls = {"slow": 0, "fast": 0, "fill": 0}
    jitter = iter([0.0, 0.5, 0.0, 0.0, 0.0] * 3)  # slow outliers; the fastest run ignores them

    def run_slow(n: int) -> None:
        calls["slow"] += 1
        clock.now += 3e-3 + n * 2e-3 + next(jitter, 0.0)  # a fixed cost per call (the pool's wake-up), not per token

    def run_fast(n: int) -> None:
        calls["fast"] += 1
        clock.now += n * 5e-4

    def run_fill() -> None:
        calls["fill"] += 1
        clock.now += 9e-3

    p = measure_latency(run_slow, run_fast, run_fill, n_tokens=4, repeats=5, warmup=1, clock=clock)
    assert p.lat_slow_per_token == pytest.approx(2e-3)
    assert p.lat_fast_per_token == pytest.approx(5e-4)
    assert p.fill_seconds == pytest.approx(9e-3)
    assert calls == {"slow": 12, "fast": 6, "fill": 6}  # warmup + repeats each (the slow path at n and 4n)
    assert n_critical(p) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        measure_latency(run_slow, run_fast, run_fill, n_tokens=0)


def test_measure_latency_real_clock_smoke():
    p = measure_latency(lambda n: sum(range(50 * n)), lambda n: sum(range(n)), lambda: sum(range(500)),
                        n_tokens=4, repeats=3)
    assert p.lat_slow_per_token >= 0 and p.lat_fast_per_token >= 0 and p.fill_seconds >= 0


# ------------------------------------------------------------------------------------------ per-miss admission


def test_admit_fill_compares_expected_reload_time():
    from hexq.runtime.cost import admit_fill

    assert admit_fill(0.5, 1.0, [(0.2, 1.0), (0.2, 1.0)])  # 0.5 > 0.4
    assert not admit_fill(0.5, 1.0, [(0.3, 1.0), (0.2, 1.0)])  # a tie keeps the transient load
    assert admit_fill(0.3, 2.0, [(0.5, 1.0)])  # a costlier reload is worth keeping
    assert admit_fill(1e-9, 1.0, [])  # nothing to evict
    with pytest.raises(ValueError, match=">= 0"):
        admit_fill(-1.0, 1.0, [])


def test_usage_update_is_a_per_token_moving_average():
    from hexq.runtime.cost import usage_update

    u = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    counts = torch.tensor([2, 0, 1])
    one_pass = usage_update(u, counts, 2, horizon=4.0)
    # the same tokens one at a time give the same estimate when each token contributes its share
    step = usage_update(usage_update(u, torch.tensor([1, 0, 0]), 1, 4.0), torch.tensor([1, 0, 1]), 1, 4.0)
    keep = 0.75 ** 2
    assert torch.allclose(one_pass, u * keep + counts.double() * (1 - keep) / 2)
    assert torch.allclose(one_pass[:2], step[:2])  # experts used the same way in both orders
    assert torch.equal(usage_update(u, counts, 0, 4.0), u)
    with pytest.raises(ValueError, match="horizon"):
        usage_update(u, counts, 1, 0.5)


def test_calibration_usage_is_uses_per_token():
    from hexq.runtime.cost import calibration_usage

    counts = torch.tensor([[6, 2, 0, 0], [0, 0, 0, 0]])  # 4 tokens top-2 in layer 0, nothing in layer 1
    usage = calibration_usage(counts, top_k=2)
    assert torch.allclose(usage[0], torch.tensor([1.5, 0.5, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(usage[1], torch.zeros(4, dtype=torch.float64))
