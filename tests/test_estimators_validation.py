"""Conformance suite, continued from tests/test_estimators_conformance.py (whose instances it runs on): T10 validation,
dtype, devices and masks for every class in ``estimators.ESTIMATORS``, and each class's constructor validation
(docs/theory.md §2.7, docs/reference_numbers.md §8.2)."""

from __future__ import annotations

import math

import pytest
import torch

from estimators import GRPO, MaxRL, SoftmaxGRPO
from tests.test_estimators_conformance import CASES, IDS, norm_scale, random_rewards
from tests.test_estimators_conformance import _one_thread as _one_thread  # one intra-op thread (autouse)

# ---------------------------------------------------------------------------------------------
# T10 validation, dtype, masks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_rejects_invalid_rewards(est):
    """T10: non-finite rewards, G < 2, and tensors that are not [B, G] raise."""
    good = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    for bad in (math.nan, math.inf, -math.inf):
        r = good.clone()
        r[1, 2] = bad
        with pytest.raises(ValueError, match="finite"):
            est(r)
    with pytest.raises(ValueError, match="G must be >= 2"):
        est(torch.ones(4, 1))
    with pytest.raises(ValueError, match="2-D"):
        est(torch.tensor([0.0, 1.0, 1.0]))  # 1-D
    with pytest.raises(ValueError, match="2-D"):
        est(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError):
        est([[0.0, 1.0]])
    with pytest.raises(ValueError, match="mask"):
        est(good, mask=torch.ones(2, 3))  # not bool
    with pytest.raises(ValueError, match="mask"):
        est(good, mask=torch.ones(2, 2, dtype=torch.bool))  # wrong shape


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_nonnegative_rewards_enforced_when_required(est):
    """T10: MaxRL (which divides by the mean) rejects negative rewards; the others accept them."""
    r = torch.tensor([[0.0, 1.0, -0.5], [1.0, 0.0, 0.0]])
    if est.requires_nonnegative_rewards:
        with pytest.raises(ValueError, match=">= 0"):
            est(r)
        # a negative reward in a masked-out slot is not a reward
        mask = torch.tensor([[True, True, False], [True, True, True]])
        assert torch.isfinite(est(r, mask=mask)).all()
    else:
        assert torch.isfinite(est(r)).all()


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_dtype_preserved_and_computed_in_float64(est):
    """float32 in -> float32 out (etc.), and the value is the float64 result rounded once."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        r = random_rewards(est, 200, 8, seed=7).to(dtype)
        a = est(r)
        assert a.dtype == dtype and a.shape == r.shape
        assert torch.equal(a, est(r.to(torch.float64)).to(dtype)), dtype


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_follows_the_inputs_device(est):
    """Advantages (with and without a mask) and the exact theory stay on the inputs' device whatever torch's
    default device is: with ``meta`` as the default, a tensor made without ``device=`` lands on ``meta``
    and the first operation mixing it with the CPU inputs raises (tests/test_device.py)."""
    r = random_rewards(est, 50, 8, seed=3)
    p = torch.tensor([0.0, 0.3, 1.0], dtype=torch.float64)
    with torch.device("meta"):
        outputs = [est(r), est(r, mask=r > 0.2), est.population_weight(p, 8), est.population_objective(p, 8)]
    assert all(out.device.type == "cpu" for out in outputs)
    assert torch.equal(outputs[0], est(r)) and torch.equal(outputs[2], est.population_weight(p, 8))


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_integer_rewards_give_default_float_dtype(est):

    r = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    a = est(r)
    assert a.dtype == torch.get_default_dtype()
    torch.testing.assert_close(a, est(r.double()).to(a.dtype))


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_mask_equals_estimator_on_valid_members(est):
    """A masked group equals the estimator on its valid members only (G = their count); masked-out
    members, and groups with fewer than 2 valid members, get exactly 0; masked-out NaN is ignored."""
    g = 10
    r = random_rewards(est, 120, g, seed=8)
    gen = torch.Generator().manual_seed(9)
    counts = torch.randint(0, g + 1, (r.shape[0],), generator=gen)
    counts[:3] = torch.tensor([0, 1, 2])
    keys = torch.rand(r.shape, generator=gen)
    ranks = keys.argsort(-1).argsort(-1)
    mask = ranks < counts.unsqueeze(1)  # `counts` valid members per row, at random positions
    r = torch.where(mask, r, math.nan)
    a = est(r, mask=mask)
    assert torch.isfinite(a).all()
    assert torch.equal(a[~mask], torch.zeros_like(a[~mask]))
    for row in range(r.shape[0]):
        n = int(counts[row])
        if n < 2:
            assert torch.equal(a[row], torch.zeros(g, dtype=a.dtype))
            continue
        alone = est(r[row, mask[row]].unsqueeze(0))[0]
        torch.testing.assert_close(a[row, mask[row]], alone, rtol=0, atol=1e-13 * norm_scale(alone))


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_full_mask_and_batch_independence(est):
    """An all-True mask is no mask; a group's advantages do not depend on the other groups."""
    r = random_rewards(est, 80, 6, seed=10)
    a = est(r)
    assert torch.equal(est(r, mask=torch.ones_like(r, dtype=torch.bool)), a)
    for row in range(0, r.shape[0], 7):
        torch.testing.assert_close(est(r[row : row + 1])[0], a[row], rtol=0, atol=1e-14 * norm_scale(a))
    assert est(torch.zeros(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_binary_table_is_the_estimator_on_binary_groups(est):
    """binary_group_advantages(G)[K] is the estimator on K successes then G-K failures, and a
    symmetric estimator gives all successes (and all failures) of a group the same advantage."""
    g = 8
    table = est.binary_group_advantages(g)
    assert table.shape == (g + 1, g) and table.dtype == torch.float64
    for k in range(g + 1):
        r = torch.tensor([[1.0] * k + [0.0] * (g - k)], dtype=torch.float64)
        assert torch.equal(table[k], est(r)[0])
        if k > 0:
            assert (table[k, :k] - table[k, 0]).abs().max() <= 1e-12 * norm_scale(table)
        if k < g:
            assert (table[k, k:] - table[k, -1]).abs().max() <= 1e-12 * norm_scale(table)
    deltas = est.binary_deltas(g)
    torch.testing.assert_close(deltas, table[1:, 0] - table[:-1, -1], rtol=0, atol=0)


@pytest.mark.parametrize("est", CASES, ids=IDS)
def test_inherited_theory_is_consistent_and_matches_sampling(est):
    """For every estimator: F_G(0) = 0, d/dp F_G = c_G (finite difference), and c_G(p) is the mean of
    sum_i A_i (r_i - p)/(p(1-p)) over 60,000 sampled groups (Bernoulli-logit policy, 5 SE + 0.1%),
    which also catches an estimator that is not permutation symmetric."""
    g, p, h, m = 8, 0.3, 1e-5, 60_000
    c = est.population_weight(p, g).item()
    assert math.isfinite(c) and est.population_objective(0.0, g).item() == 0.0
    fd = (est.population_objective(p + h, g) - est.population_objective(p - h, g)).item() / (2 * h)
    assert fd == pytest.approx(c, rel=1e-6)
    r = (torch.rand(m, g, generator=torch.Generator().manual_seed(11), dtype=torch.float64) < p).double()
    u = (est(r) * (r - p)).sum(-1) / (p * (1 - p))
    se = u.std().item() / math.sqrt(m)
    assert abs(u.mean().item() - c) <= 5 * se + 1e-3 * abs(c)


# ---------------------------------------------------------------------------------------------
# constructor validation (per class)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [0.0, -1.0, -1e-9, math.nan, math.inf, -math.inf, "0.5", None, True])
def test_softmax_rejects_bad_temperature(tau):
    """T10: tau must be a finite real > 0 (in reward units)."""
    with pytest.raises(ValueError, match="temperature"):
        SoftmaxGRPO(tau)


def test_softmax_accepts_real_number_types():
    import numpy as np

    for tau in (1, 0.5, np.float32(0.5), np.float64(2.0)):
        assert SoftmaxGRPO(tau).temperature == float(tau)
    with pytest.raises(TypeError):
        SoftmaxGRPO()  # no default temperature: it is a required setting (docs/theory.md §2.6)


def test_other_constructors_validate():
    with pytest.raises(ValueError, match="std"):
        GRPO(std="unbiased")
    for eps in (-1e-6, math.nan, math.inf):
        with pytest.raises(ValueError, match="eps"):
            GRPO(eps=eps)
    with pytest.raises(ValueError, match="variant"):
        MaxRL(variant="order_g")
