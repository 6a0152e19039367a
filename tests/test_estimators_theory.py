"""Theory tests: limits (T7, T8, T14), stability (T9), exact expected updates (T11), the large-group weight and
objective of SoftmaxGRPO. Monte Carlo (T13) and the theory a user's new estimator inherits:
tests/test_estimators_sampling.py; scalar (discrete) rewards, T15 and the curl of the expected update:
tests/test_estimators_discrete.py.

The formulas are those of docs/theory.md §2 and docs/objective.md §3-§4; reference values come from an independent
numpy/scipy implementation of them (closed forms and Monte Carlo), not from the library.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from estimators import GRPO, RLOO, AdvantageEstimator, DrGRPO, MaxRL, SoftmaxGRPO


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


F64 = torch.float64
P_GRID = [0.0, 1e-3, 0.05, 0.25, 0.5, 0.75, 0.95, 0.999, 1.0]


def all_binary_groups(g: int) -> torch.Tensor:
    """All 2^G binary reward vectors of size G, float64 [2^G, G]."""
    codes = torch.arange(2**g).unsqueeze(1)
    return ((codes >> torch.arange(g)) & 1).to(F64)


# ---------------------------------------------------------------------------------------------
# T7, T8, T14: temperature limits
# ---------------------------------------------------------------------------------------------


def test_t7_low_temperature_is_maxrl_on_every_binary_group():
    """T7 / must-show: SoftmaxGRPO(tau = 1e-3) equals MaxRL() (practical) on every binary group of size
    2..16, to 1e-12: A = G/K - 1 on successes, -1 on failures, 0 when K = 0 or K = G."""
    soft, maxrl = SoftmaxGRPO(temperature=1e-3), MaxRL()
    for g in range(2, 17):
        r = all_binary_groups(g)
        a_soft, a_max = soft(r), maxrl(r)
        assert (a_soft - a_max).abs().max().item() <= 1e-12, g
    # hand check, G = 4, K = 1: MaxRL gives 4/1 - 1 = 3 and -1, -1, -1
    torch.testing.assert_close(
        soft(torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=F64)),
        torch.tensor([[-1.0, 3.0, -1.0, -1.0]], dtype=F64),
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize("g", [2, 5, 16, 64])
def test_t7_scalar_rewards_hard_max_limit(g):
    """T7: with scalar rewards and gap/tau >= 40 the advantage is the hard max: G/#argmax - 1 on the
    argmax set, -1 elsewhere (1e-12). Rewards on a 2-decimal grid (gap >= 0.01), tau = 2.5e-4."""
    gen = torch.Generator().manual_seed(g)
    r = torch.randint(0, 101, (400, g), generator=gen).to(F64) / 100
    r[:50] = torch.randint(95, 101, (50, g), generator=gen).to(F64) / 100  # many tied maxima
    a = SoftmaxGRPO(2.5e-4)(r)
    top = r == r.amax(-1, keepdim=True)
    n_top = top.sum(-1, keepdim=True).to(F64)
    expected = torch.where(top, g / n_top - 1, -1.0)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tau", [1e2, 1e3, 1e4, 1e5, 1e6])
def test_t8_high_temperature_is_drgrpo_over_tau(tau):
    """T8: |tau A - (r - mean)| <= range^2 / tau for tau >= 10 range (range 1); the error is the
    second-order term ((r - mean)^2 - Var)/(2 tau) (measured ~0.21/tau in §B), up to O(1/tau^2)."""
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(500, 8, generator=gen, dtype=F64)
    r[:, 0], r[:, 1] = 0.0, 1.0  # range exactly 1
    c = DrGRPO()(r)  # r - mean
    err = tau * SoftmaxGRPO(tau)(r) - c
    assert err.abs().max().item() <= 1.0 / tau
    second_order = (c.square() - c.square().mean(-1, keepdim=True)) / (2 * tau)
    assert (err - second_order).abs().max().item() <= 1.0 / tau**2
    assert err.abs().max().item() >= 0.1 / tau  # the bound is sharp: the error really is O(1/tau)
    # scale_by_tau gives Dr.GRPO itself in the limit
    scaled = SoftmaxGRPO(tau, scale_by_tau=True)(r)
    assert (scaled - c).abs().max().item() <= 1.0 / tau


def test_t14_limits_of_the_weight():
    """T14: c_G at tau = 0.002 equals MaxRL practical (1e-9 relative); tau c_G at tau = 1e4 equals
    G - 1 (1e-2). §B: at G = 8, 48.26603263 vs 48.26603263 (p = .05) and tau c = 7.000236."""
    p = torch.tensor(P_GRID, dtype=F64)
    for g in (2, 3, 8, 16, 32):
        cold, maxrl = SoftmaxGRPO(0.002).population_weight(p, g), MaxRL().population_weight(p, g)
        torch.testing.assert_close(cold, maxrl, rtol=1e-9, atol=0)
        hot = 1e4 * SoftmaxGRPO(1e4).population_weight(p, g)
        torch.testing.assert_close(hot, torch.full_like(hot, g - 1.0), rtol=0, atol=1e-2)
    assert SoftmaxGRPO(0.002).population_weight(0.05, 8).item() == pytest.approx(48.26603263, abs=1e-8)
    assert 1e4 * SoftmaxGRPO(1e4).population_weight(0.05, 8).item() == pytest.approx(7.000236, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# T9: stability against a high-precision reference
# ---------------------------------------------------------------------------------------------


def mp_softmax_advantages(rewards: list[float], tau: float) -> list[float]:
    """G exp(r_i/tau) / sum_j exp(r_j/tau) - 1 in 60-digit arithmetic (floats convert exactly)."""
    with mpmath.workdps(60):
        x = [mpmath.mpf(v) / mpmath.mpf(tau) for v in rewards]
        top = max(x)
        e = [mpmath.exp(v - top) for v in x]
        mean = mpmath.fsum(e) / len(e)
        return [float(v / mean - 1) for v in e]


def stability_rows(g: int, scale: float, tau: float, gen: torch.Generator) -> torch.Tensor:
    """Rewards with |r| <= scale: uniform, binary and signed groups, and offset groups sitting near
    +-scale or inside with a spread of exactly k tau for k in {0.05, 0.07, 0.5, 5} (both sides of
    the implementation's exp/expm1 switch at 1/16, and the cases where forming r/tau first would lose
    the differences)."""
    u = torch.rand(7, g, generator=gen, dtype=F64)
    u[:, 0], u[:, -1] = 0.0, 1.0  # pin the spread of the offset rows
    rows = [u[0] * scale, (u[1] > 0.5).to(F64) * scale, (2 * u[2] - 1) * scale]
    for row, (k, base) in enumerate(((0.05, 0.3), (0.07, -0.7), (0.5, 1.0), (5.0, -1.0)), start=3):
        if k * tau < scale / 4:
            rows.append(base * scale - k * tau * u[row] * (1 if base > 0 else -1))
        else:
            rows.append((2 * u[row] - 1) * scale)
    return torch.stack(rows)


def test_t9_stability_against_mpmath():
    """T9: finite outputs and normwise relative error max|A - A*| / max|A*| <= 1e-12 against a 60-digit
    reference, for tau in [1e-4, 1e8], |r| <= 1e6, G in [2, 1024]."""
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for g in (2, 3, 8, 64, 1024):
        for tau in (1e-4, 1e-2, 0.3, 1.0, 30.0, 1e4, 1e8):
            for scale in (1.0, 1e6):
                r = stability_rows(g, scale, tau, gen)
                if g == 1024:
                    r = r[[0, 4, 6]]  # keep the 60-digit reference to a few seconds
                a = SoftmaxGRPO(tau)(r)
                assert torch.isfinite(a).all()
                for row in range(r.shape[0]):
                    if r[row].amax() == r[row].amin():
                        continue
                    ref = torch.tensor(mp_softmax_advantages(r[row].tolist(), tau), dtype=F64)
                    err = ((a[row] - ref).abs().max() / ref.abs().max()).item()
                    worst = max(worst, err)
                    assert err <= 1e-12, (g, tau, scale, row, err)
    assert worst > 0  # the reference is independent: some rounding is always visible


def test_t9_extremes_stay_finite():
    """Overflowing r/tau (1e300 / 1e-4) and tiny spreads at huge magnitude stay finite and exact."""
    r = torch.tensor([[1e300, -1e300, 0.0], [1e6, 1e6 + 1e-9, 1e6 - 1e-9], [-1e6, 1e6, 1e6]], dtype=F64)
    for tau in (1e-4, 1.0, 1e8):
        a = SoftmaxGRPO(tau)(r)
        assert torch.isfinite(a).all()
        assert (a >= -1).all() and (a <= 2).all()
    a = SoftmaxGRPO(1e-4)(r)
    torch.testing.assert_close(a[0], torch.tensor([2.0, -1.0, -1.0], dtype=F64), rtol=0, atol=0)
    torch.testing.assert_close(a[2], torch.tensor([-1.0, 0.5, 0.5], dtype=F64), rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# T11: closed forms of docs/objective.md §4 against the generic lemma (binomial sum over the estimator)
# ---------------------------------------------------------------------------------------------


def binom_pmf(n: int, p: float) -> list[float]:
    """P(K = k), k = 0..n, with exact integer binomial coefficients (independent of the library)."""
    return [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]


def closed_delta(est: AdvantageEstimator, g: int) -> list[float]:
    """Delta(k) = a_+(k+1) - a_-(k), k = 0..G-1, from docs/objective.md §4.2."""
    ks = range(g)
    if isinstance(est, GRPO):
        pop = [math.sqrt((g - 1 - k) / (k + 1)) + math.sqrt(k / (g - k)) for k in ks]
        return pop if est.std == "population" else [d * math.sqrt((g - 1) / g) for d in pop]
    if isinstance(est, DrGRPO):
        return [(g - 1) / g] * g
    if isinstance(est, RLOO):
        return [1.0] * g
    if isinstance(est, MaxRL):
        return [g / (k + 1) - (k == 0 and est.variant == "practical") for k in ks]
    if isinstance(est, SoftmaxGRPO):
        ib = math.exp(-1 / est.temperature)  # overflow-free form with ib = e^(-1/tau)
        return [g / (g * ib + (k + 1) * (1 - ib)) - (1.0 if k == 0 else g * ib / (g * ib + k * (1 - ib))) for k in ks]
    raise AssertionError(type(est))


def closed_weight(est: AdvantageEstimator, g: int, p: float) -> float:
    """c_G(p) in closed form where one exists (docs/objective.md §4), else G E_k[Delta(k)], k ~ Bin(G-1, p)."""
    if isinstance(est, DrGRPO):
        return g - 1.0
    if isinstance(est, RLOO):
        return float(g)
    if isinstance(est, MaxRL):
        order = g - 1 if est.variant == "practical" else g
        return g * order if p == 0 else g * (1 - (1 - p) ** order) / p
    return g * sum(w * d for w, d in zip(binom_pmf(g - 1, p), closed_delta(est, g)))


def closed_objective(est: AdvantageEstimator, g: int, p: float) -> float:
    """F_G(p) with F_G(0) = 0 (docs/objective.md §3.2, §4)."""
    if isinstance(est, DrGRPO):
        return (g - 1) * p
    if isinstance(est, RLOO):
        return g * p
    if isinstance(est, MaxRL):
        order = g - 1 if est.variant == "practical" else g
        return g * sum((1 - (1 - p) ** j) / j for j in range(1, order + 1))  # G sum pass@j / j
    if isinstance(est, SoftmaxGRPO):
        # Phi_tau(K) = sum_{j<=K} G lam/(1 + j lam) - K lam/(1 + K lam), lam = (beta-1)/G, overflow-free
        ib = math.exp(-1 / est.temperature)

        def phi(k: int) -> float:
            head = sum(g * (1 - ib) / (g * ib + j * (1 - ib)) for j in range(1, k + 1))
            return head - k * (1 - ib) / (g * ib + k * (1 - ib))

        return sum(w * phi(k) for k, w in enumerate(binom_pmf(g, p)))
    # GRPO: E_K[Phi(K)], Phi(K) = sum_{k<K} Delta(k)
    delta = closed_delta(est, g)
    return sum(w * sum(delta[:k]) for k, w in enumerate(binom_pmf(g, p)))


THEORY_CASES = [
    GRPO("population", eps=0.0),
    GRPO("sample", eps=0.0),
    DrGRPO(),
    RLOO(),
    MaxRL("practical"),
    MaxRL("cv_unbiased"),
    MaxRL("nocv"),
    SoftmaxGRPO(0.05),
    SoftmaxGRPO(0.25),
    SoftmaxGRPO(1.0),
    SoftmaxGRPO(4.0),
    SoftmaxGRPO(100.0),
]


@pytest.mark.parametrize("est", THEORY_CASES, ids=repr)
def test_t11_closed_forms_match_the_lemma(est):
    """T11: Delta(k), c_G(p) and F_G(p) of the implementation equal the §4.3 closed forms (1e-10 rel)."""
    p = torch.tensor(P_GRID, dtype=F64)
    for g in (2, 3, 5, 8, 16, 64):
        torch.testing.assert_close(
            est.binary_deltas(g), torch.tensor(closed_delta(est, g), dtype=F64), rtol=1e-10, atol=1e-300
        )
        c = torch.tensor([closed_weight(est, g, q) for q in P_GRID], dtype=F64)
        torch.testing.assert_close(est.population_weight(p, g), c, rtol=1e-10, atol=1e-300)
        f = torch.tensor([closed_objective(est, g, q) for q in P_GRID], dtype=F64)
        torch.testing.assert_close(est.population_objective(p, g), f, rtol=1e-10, atol=1e-300)


def test_t11_endpoint_closed_forms():
    """c(0+), c(1-) of docs/objective.md §4.1 at G = 16 (1e-10 relative)."""
    g, ends = 16, torch.tensor([0.0, 1.0], dtype=F64)
    expect = {
        GRPO("population", eps=0.0): [g * math.sqrt(g - 1)] * 2,
        GRPO("sample", eps=0.0): [(g - 1) * math.sqrt(g)] * 2,
        DrGRPO(): [g - 1.0] * 2,
        RLOO(): [float(g)] * 2,
        MaxRL("practical"): [g * (g - 1.0), float(g)],
        MaxRL("cv_unbiased"): [g * g * 1.0, float(g)],
    }
    for tau in (0.25, 1.0, 2.0):
        bm1 = math.expm1(1 / tau)  # beta - 1
        expect[SoftmaxGRPO(tau)] = [g * (g - 1) * bm1 / (g + bm1), g * (g - 1) * bm1 / (1 + (g - 1) * (bm1 + 1))]
    for est, values in expect.items():
        torch.testing.assert_close(est.population_weight(ends, g), torch.tensor(values, dtype=F64), rtol=1e-10, atol=0)


@pytest.mark.parametrize("est", [GRPO(), *THEORY_CASES[2:7], SoftmaxGRPO(0.5)], ids=repr)
def test_t11_objective_derivative_is_the_weight(est):
    """d/dp F_G(p) = c_G(p) (central finite difference, h = 1e-5, 1e-7 relative), F_G(0) = 0."""
    p = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9], dtype=F64)
    h = 1e-5
    for g in (2, 8, 16):
        fd = (est.population_objective(p + h, g) - est.population_objective(p - h, g)) / (2 * h)
        torch.testing.assert_close(fd, est.population_weight(p, g), rtol=1e-7, atol=0)
        assert est.population_objective(0.0, g).item() == 0.0


#: output file §C2: F_G(p)/G at G = 8, 64, 1024 and the limit log E[e^(r/tau)] = log(1 - p + p e^(1/tau))
TABLE_C2 = [
    (0.25, 0.1, [0.53245, 1.49105, 1.82423], 1.85000),
    (0.25, 0.5, [1.72088, 2.95421, 3.29861], 3.32500),
    (0.25, 0.9, [2.28762, 3.52549, 3.87025], 3.89667),
    (1.00, 0.1, [0.11842, 0.15290, 0.15820], 0.15857),
    (1.00, 0.5, [0.50507, 0.60511, 0.61917], 0.62011),
    (1.00, 0.9, [0.79460, 0.91680, 0.93358], 0.93470),
]


@pytest.mark.parametrize(("tau", "p", "per_g", "limit"), TABLE_C2)
def test_objective_tends_to_the_log_mgf(tau, p, per_g, limit):
    """F_G(p)/G -> log E[e^(r/tau)] (§C2, 5 decimals), the limit from large_group_objective. By hand at
    tau = 1, p = 1/2: log((1 + e)/2) = 0.62011."""
    est = SoftmaxGRPO(tau)
    for g, value in zip((8, 64, 1024), per_g):
        assert est.population_objective(p, g).item() / g == pytest.approx(value, abs=2e-5)
    law = est.large_group_objective(torch.tensor([0.0, 1.0]), torch.tensor([1 - p, p], dtype=F64))
    assert law.item() == pytest.approx(limit, abs=2e-5)
    assert law.item() == pytest.approx(math.log(1 - p + p * math.exp(1 / tau)), rel=1e-14)
    scaled = SoftmaxGRPO(tau, scale_by_tau=True)
    assert scaled.large_group_objective(torch.tensor([0.0, 1.0]), torch.tensor([1 - p, p])).item() == (
        pytest.approx(tau * law.item(), rel=1e-6)
    )


def test_large_group_objective_validation():
    est = SoftmaxGRPO(1.0)
    with pytest.raises(ValueError, match="shape"):
        est.large_group_objective(torch.tensor([0.0, 1.0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="sum to 1"):
        est.large_group_objective(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.6]))
    with pytest.raises(ValueError, match="standardize"):
        SoftmaxGRPO(1.0, standardize=True).large_group_weight(0.5)


# ---------------------------------------------------------------------------------------------
# large-group weight of SoftmaxGRPO (docs/objective.md §4.3, docs/reference_numbers.md §8.1)
# ---------------------------------------------------------------------------------------------

LARGE_G_TABLE = {
    0.25: [14.5651, 3.7222, 1.9281, 1.3010, 1.0324],
    0.5: [4.8422, 2.4599, 1.5232, 1.1031, 0.9037],
    1.0: [1.5823, 1.2020, 0.9242, 0.7508, 0.6528],
    2.0: [0.6283, 0.5582, 0.4898, 0.4364, 0.4014],
}
P5 = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=F64)


@pytest.mark.parametrize("tau", sorted(LARGE_G_TABLE))
def test_large_group_weight_table(tau):
    """§5 large-G table (1e-4); by hand at tau = 1, p = 1/2: (e - 1)/(1 + (e - 1)/2) = 0.92423."""
    est = SoftmaxGRPO(tau)
    w = est.large_group_weight(P5)
    torch.testing.assert_close(w, torch.tensor(LARGE_G_TABLE[tau], dtype=F64), rtol=0, atol=1e-4)
    assert SoftmaxGRPO(tau, scale_by_tau=True).large_group_weight(0.5).item() == pytest.approx(tau * w[2].item())


@pytest.mark.parametrize("tau", [0.25, 1.0, 2.0])
def test_population_weight_per_rollout_tends_to_large_group_weight(tau):
    """c_G(p)/G -> (beta - 1)/(1 + p (beta - 1)) with an O(1/G) error."""
    est = SoftmaxGRPO(tau)
    w = est.large_group_weight(P5)
    errs = [((est.population_weight(P5, g) / g - w).abs() / w).max().item() for g in (64, 256, 1024)]
    assert errs[2] <= 0.01
    assert errs[2] < errs[1] / 3 < errs[0] / 9  # roughly 1/G


@pytest.mark.parametrize("tau", [0.25, 0.5, 1.0, 2.0])
def test_softmax_weight_is_bounded_and_decreasing(tau):
    """0 < c_G(p)/G < e^(1/tau) - 1 for all p, G; strictly decreasing in p for G >= 3, constant at G = 2;
    never above MaxRL practical (§3.2c, §4.3). GRPO's sup c_G/G = sqrt(G-1) is unbounded, for contrast."""
    est = SoftmaxGRPO(tau)
    p = torch.linspace(0, 1, 401, dtype=F64)
    bound = math.expm1(1 / tau)
    for g in (2, 3, 8, 64, 256):
        c = est.population_weight(p, g)
        assert (c > 0).all() and (c / g < bound).all()
        if g == 2:
            torch.testing.assert_close(c, torch.full_like(c, c[0].item()), rtol=1e-12, atol=0)
        else:
            assert (c.diff() < 0).all()
        assert (c <= MaxRL().population_weight(p, g) * (1 + 1e-12)).all()
    grpo_end = GRPO("population", eps=0.0).population_weight(1.0, 256).item() / 256
    assert grpo_end == pytest.approx(math.sqrt(255), rel=1e-10) and grpo_end > 15


@pytest.mark.parametrize("tau", [0.1, 0.5, 1.0, 4.0])
def test_softmax_delta_differences_closed_form(tau):
    """The proof of monotonicity (docs/objective.md §4.3): Delta(k+1) - Delta(k) =
    lam^2 (2 - G - G k lam) / ((1 + k lam)(1 + (k+1) lam)(1 + (k+2) lam)) < 0 for G >= 3 (0 at G = 2),
    and c_G'(p) = G (G-1) E_{k~Bin(G-2,p)}[Delta(k+1) - Delta(k)] (central difference, 1e-6 relative)."""
    est = SoftmaxGRPO(tau)
    for g in (2, 3, 8, 64):
        lam = math.expm1(1 / tau) / g
        k = torch.arange(g - 1, dtype=F64)
        closed = lam**2 * (2 - g - g * k * lam) / ((1 + k * lam) * (1 + (k + 1) * lam) * (1 + (k + 2) * lam))
        torch.testing.assert_close(est.binary_deltas(g).diff(), closed, rtol=1e-9, atol=1e-13)
        assert (closed < 0).all() if g >= 3 else closed.abs().max().item() == 0
        if g == 2:
            continue
        p = torch.tensor([0.1, 0.5, 0.9], dtype=F64)
        derivative = g * (g - 1) * (torch.tensor([binom_pmf(g - 2, x) for x in p.tolist()], dtype=F64) @ closed)
        h = 1e-6
        fd = (est.population_weight(p + h, g) - est.population_weight(p - h, g)) / (2 * h)
        torch.testing.assert_close(fd, derivative, rtol=1e-6, atol=0)
