"""SoftmaxGRPO's per-group temperature rule (``temperature_rule="ess"``) and the log-MGF objective
``tau log mean_j exp(r_j / tau)`` (estimators/softmax_grpo.py), against hand-computed values (issue 26)."""

from __future__ import annotations

import math

import pytest
import torch

from estimators import SoftmaxGRPO
from estimators.softmax_grpo import ess_fraction, ess_temperatures, log_mgf


def ess(target: float) -> SoftmaxGRPO:
    return SoftmaxGRPO(None, temperature_rule="ess", target_ess=target)


def test_ess_rule_two_members_by_hand():
    # G = 2, rewards (0, 1): ESS = (1 + b)^2 / (2 (1 + b^2)) with b = e^(1/tau); = 0.9 at b^2 - 2.5 b + 1 = 0,
    # b = 2: tau = 1/ln 2, weights (1, 2) / 3, A = 2 w - 1 = (-1/3, +1/3); shifting and scaling change nothing
    r = torch.tensor([[0.0, 1.0], [3.0, 5.0], [-7.0, -6.0]], dtype=torch.float64)
    taus = ess(0.9).group_temperatures(r)
    torch.testing.assert_close(taus, torch.tensor([1, 2, 1], dtype=torch.float64) / math.log(2), rtol=1e-12, atol=0)
    expected = torch.tensor([[-1 / 3, 1 / 3]] * 3, dtype=torch.float64)
    torch.testing.assert_close(ess(0.9)(r), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ess_fraction(r[:1], taus[0]), torch.tensor([[0.9]], dtype=torch.float64))


def test_ess_rule_binary_group_by_hand():
    # G = 4, one success: (b + 3)^2 / (4 (b^2 + 3)) = 1/2 at b^2 - 6 b - 3 = 0, b = 3 + 2 sqrt 3, and then
    # a_+ = 4 b / (b + 3) - 1 = sqrt 3, each failure 4 / (b + 3) - 1 = -sqrt(3) / 3
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    tau = ess(0.5).group_temperatures(r)
    assert tau.item() == pytest.approx(1 / math.log(3 + 2 * math.sqrt(3)), rel=1e-12)
    s3 = math.sqrt(3)
    torch.testing.assert_close(ess(0.5)(r), torch.tensor([[s3, -s3 / 3, -s3 / 3, -s3 / 3]], dtype=torch.float64))


def test_ess_rule_unreachable_target_and_constant_groups():
    # three of four members tied at the maximum: ESS >= 3/4 at every tau, so target 0.5 gets the tau -> 0
    # limit, MaxRL's advantages G/n - 1 = 1/3 on the maxima and -1 elsewhere; a constant group gets exact zeros
    r = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.3, 0.3, 0.3, 0.3]], dtype=torch.float64)
    a = ess(0.5)(r)
    torch.testing.assert_close(a[0], torch.tensor([1 / 3, 1 / 3, 1 / 3, -1.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(a[1], torch.zeros(4, dtype=torch.float64))
    assert ess_temperatures(r, 0.5)[1].item() == 1.0


def test_ess_is_increasing_in_tau_and_hit_on_scalar_groups():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(50, 8, generator=gen, dtype=torch.float64)
    taus = torch.logspace(-3, 3, 40, dtype=torch.float64)
    values = torch.cat([ess_fraction(r, t) for t in taus], dim=-1)  # [50, 40]
    assert (values.diff(dim=-1) >= -1e-15).all()
    for target in (0.2, 0.5, 0.95):
        reached = ess_fraction(r, ess_temperatures(r, target))
        torch.testing.assert_close(reached, torch.full_like(reached, target), rtol=1e-10, atol=0)


def test_log_mgf_by_hand():
    # tau log((1 + e^(1/tau)) / 2): 0.62011 at tau 1, 0.5 log((1 + e^2) / 2) = 0.71699 at tau 0.5
    r = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    torch.testing.assert_close(
        log_mgf(r, torch.tensor([1.0, 0.5])),
        torch.tensor([math.log((1 + math.e) / 2), 0.5 * math.log((1 + math.e**2) / 2)], dtype=torch.float64),
    )
    # soft maximum: mean as tau -> inf, max as tau -> 0; a constant group is its value; no overflow
    g = torch.tensor([[0.2, 0.4, 0.9]], dtype=torch.float64)
    assert log_mgf(g, 1e6).item() == pytest.approx(0.5, abs=1e-6)
    assert log_mgf(g, 1e-3).item() == pytest.approx(0.9 + 1e-3 * math.log(1 / 3), rel=1e-9)
    assert log_mgf(torch.full((1, 4), 3.25), 0.1).item() == pytest.approx(3.25, abs=1e-15)
    assert log_mgf(torch.tensor([[1e4, 1e4 + 1]]), 1e-3).item() == pytest.approx(1e4 + 1 - 1e-3 * math.log(2))


def test_log_mgf_is_the_large_group_objective_of_the_empirical_law():
    r = torch.tensor([[0.1, 0.7, 0.7, 0.2]], dtype=torch.float64)
    law = SoftmaxGRPO(0.3, scale_by_tau=True).large_group_objective(r, torch.full_like(r, 0.25))
    torch.testing.assert_close(log_mgf(r, 0.3), law)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": None, "temperature_rule": "ess", "target_ess": 1.0}, "target_ess"),
        ({"temperature": None, "temperature_rule": "ess", "target_ess": 0.0}, "target_ess"),
        ({"temperature": None, "temperature_rule": "ess"}, "target_ess"),
        ({"temperature": None, "temperature_rule": "ess", "target_ess": True}, "target_ess"),
        ({"temperature": 0.5, "temperature_rule": "ess", "target_ess": 0.5}, "temperature"),
        ({"temperature": 0.5, "target_ess": 0.5}, "target_ess"),
        ({"temperature": None}, "temperature"),
        ({"temperature": 0.5, "temperature_rule": "auto"}, "temperature_rule"),
        ({"temperature": None, "temperature_rule": "ess", "target_ess": 0.5, "scale_by_tau": True}, "scale_by_tau"),
        ({"temperature": None, "temperature_rule": "ess", "target_ess": 0.5, "standardize": True}, "standardize"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        SoftmaxGRPO(**kwargs)
    assert "\n" not in str(err.value)


def test_ess_rule_refuses_the_fixed_tau_large_group_theory():
    est = ess(0.5)
    with pytest.raises(ValueError, match="fixed temperature"):
        est.large_group_weight(0.5)
    with pytest.raises(ValueError, match="fixed temperature"):
        est.large_group_objective(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]))
    # the exact binary theory holds (a symmetric function of the group): c_G from the G + 1 binary groups;
    # G = 2 at target 0.9: Delta(0) = a_+(1) - a_-(0) = 1/3 - 0, Delta(1) = 0 + 1/3 (the two-member case), so
    # c_G(p) = 2 sum_k Bin(k; 1, p) Delta(k) = 2/3 at every p
    for p in (0.1, 0.3, 0.8):
        assert ess(0.9).population_weight(p, 2).item() == pytest.approx(2 / 3, rel=1e-12)
