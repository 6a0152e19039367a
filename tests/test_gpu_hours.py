"""benchmarks/gpu_hours.py: the FLOPs model of a paper experiment, against hand-computed values."""

from __future__ import annotations

import pytest

from benchmarks import gpu_hours as gh


def config(**model) -> dict:
    base = {"model": "Qwen/Qwen2.5-1.5B", "task": {"class_path": "tasks.DeepMath", "init_args": {"validation_size": 5}},
            "rollout": {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"max_new_tokens": 10}},
            "prompts_per_step": 2, "group_size": 4, "val_samples": 1,
            "loss": {"init_args": {"kl_coef": 0.0}}}  # fmt: skip
    return {"model": base | model, "trainer": {"max_steps": 3, "val_check_interval": 3, "devices": 8, "num_nodes": 1}}


def test_flops_of_a_step_by_hand():
    """8 rows of 130 prompt + 10 response tokens on a 1.54B model with 28 layers of attention width 1,536."""
    n, attention = 1.54e9, 2 * 28 * 1536 * (130 + 5)  # attention at the mean position of a row
    cost = gh.experiment(config())
    assert cost["generation_flops_per_step"] == pytest.approx((2 * n + attention) * (2 * 130 + 8 * 10))
    assert cost["training_flops_per_step"] == pytest.approx(8 * 140 * (6 * n + 3 * attention))  # HF, no KL
    assert cost["validations"] == 2 and cost["validation_flops"] == pytest.approx((2 * n + attention) * 5 * 140 * 2)
    hours = (3 * cost["generation_flops_per_step"] + cost["validation_flops"]) / (989e12 * 0.10)
    hours = (hours + 3 * cost["training_flops_per_step"] / (989e12 * 0.30)) / 3600
    assert gh.gpu_hours(cost, 0.10, 0.30) == pytest.approx(hours)
    # vLLM adds the trainer's forward at the sampling weights, the KL its reference, checkpointing a recompute
    heavy = config(rollout={"class_path": "sgrpo.rollout.VLLMRollout", "init_args": {"max_new_tokens": 10}},
                   loss={"init_args": {"kl_coef": 0.001}}, activation_checkpointing=True)  # fmt: skip
    assert gh.experiment(heavy)["training_flops_per_step"] == pytest.approx(8 * 140 * (12 * n + 6 * attention))
    # importance sampling off (the paper's recipes): vLLM's log-probs only feed metrics, no forward at the
    # sampling weights (one on-policy pass); several optimiser steps per step need it again
    plain = config(rollout={"class_path": "sgrpo.rollout.VLLMRollout", "init_args": {"max_new_tokens": 10}},
                   loss={"init_args": {"kl_coef": 0.001, "importance_sampling_cap": None}},
                   activation_checkpointing=True)  # fmt: skip
    assert gh.experiment(plain)["training_flops_per_step"] == pytest.approx(8 * 140 * (10 * n + 5 * attention))
    assert gh.experiment(plain)["training_passes"]["forward at the sampling weights"] == 0
    assert gh.experiment(plain | {"model": plain["model"] | {"ppo_epochs": 2}})["training_flops_per_step"] == (
        pytest.approx(8 * 140 * (12 * n + 6 * attention)))
    # the cap null with other importance corrections still weighs vLLM's rows (the forward runs); bypass never does
    for init, passes in (({"importance_sampling_cap": None, "corrections": [{"class_path": "sgrpo.train.TokenMask"}]},
                          2), ({"bypass": True}, 0)):  # fmt: skip
        corrected = config(rollout=plain["model"]["rollout"], loss={"init_args": init})
        assert gh.experiment(corrected)["training_passes"]["forward at the sampling weights"] == passes, init
    assert gh.experiment(config(), fill=0.5)["response_tokens"] == 5
    # validate_last: one more validation when the interval (2) does not fall on the last step (3)
    last = config() | {"validate_last": True}
    last["trainer"] = last["trainer"] | {"val_check_interval": 2}
    assert gh.experiment(last)["validations"] == 3
    assert gh.experiment(last | {"validate_last": False})["validations"] == 2


def test_every_paper_experiment_is_priced_and_a_measurement_calibrates_them_all():
    configs = gh.load_configs()
    result = gh.estimate(configs)["experiments"]
    assert sorted(result) == sorted(configs)
    for name, e in result.items():
        h = e["gpu_hours"]
        assert 0 < h["low"] < h["central"] < h["high"] and h["central_half_length"] < h["central"], name
    step = result["deepmath"]["step_seconds_central"]
    doubled = gh.estimate(configs, ("deepmath", 2 * step))["experiments"]
    for name in configs:
        assert doubled[name]["gpu_hours"]["central"] == pytest.approx(2 * result[name]["gpu_hours"]["central"])
    assert gh.quickstart_rate()["share_of_peak"] < 1e-4  # the quickstart's H200 step is overhead, not FLOPs


def test_a_run_bounded_by_epochs_is_priced_at_its_steps():
    """qwen3's configs stop on ``max_epochs`` (``max_steps: -1``): 5 epochs of ceil(53,000 / 256) = 208 steps."""
    assert gh.run_steps({"max_steps": -1, "max_epochs": 5}, "tasks.Polaris", 256) == 1040
    assert gh.run_steps({"max_steps": 3220, "max_epochs": 5}, "tasks.Polaris", 256) == 3220
