"""The `python -m sgrpo.fit` entry: a smoke fit of configs/tiny.yaml, resume, and config errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sgrpo.export import main as export
from sgrpo.fit import main
from sgrpo.model.tiny import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def fit(root: Path, model_dir: str, *extra: str):
    args = [
        "--config",
        TINY,
        f"--trainer.default_root_dir={root}",
        f"--model.model={model_dir}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        *extra,
    ]
    return main(args)


def metrics(root: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted((root / "lightning_logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows += [r for r in csv.DictReader(f) if r.get("train/reward")]
    return rows


def test_tiny_fit_logs_checkpoints_and_exports(tmp_path, model_dir):
    cli = fit(tmp_path, model_dir, "--trainer.max_steps=3")
    rows = metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert {
        "train/reward",
        "train/success_rate",
        "train/budget/l1/hard",
        "train/budget/l2/near_solved",
        "train/clip/low",
        "train/entropy",
        "train/throughput/rollout_tok_s",
    } <= set(rows[0])
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert list(tmp_path.glob("lightning_logs/version_0/config.yaml"))

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model")
    policy = cli.model.model
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, policy(ids).logits, atol=1e-6, rtol=1e-5)
    trained = dict(policy.named_parameters())
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    assert any(not torch.equal(p, trained[n]) for n, p in initial.named_parameters())  # it learned something


def test_the_paper_recipes_settings_in_a_tiny_fit(tmp_path, model_dir):
    """The paper's recipes as verl ran them: top-p in training (the kept mass logged), verl's token-mean over loss
    micro-batches of 3 rows with the k3 clamp, the mean reward validated, and a validation at the last step (3)
    although the interval (2) does not fall on it; before training too."""
    cli = fit(tmp_path, model_dir, "--trainer.max_steps=3", "--trainer.val_check_interval=2", "--validate_last=true",
              "--validate_before=true", "--model.rollout.init_args.top_p=0.9", "--model.val_reward=true",
              "--model.loss=sgrpo.train.ClippedSurrogate", "--model.loss.aggregation=micro_batch_token_mean",
              "--model.loss.micro_batch_rows=3", "--model.loss.kl_coef=0.01", "--model.loss.kl_max=10")  # fmt: skip
    assert [v["step"] for v in cli.model.val_history] == [0, 2, 3]
    assert 0.0 <= cli.model.val_history[-1]["reward"] <= 1.0
    rows = metrics(tmp_path)
    masses = [float(r["train/rollout/nucleus_mass"]) for r in rows]
    assert len(masses) == 3 and all(0.9 <= m <= 1.0 for m in masses), masses
    assert cli.model.loss.rows_per_group == 3 and cli.model.rollout.top_p == 0.9


def test_each_validation_of_a_fit_logs_its_own_mean_reward(tmp_path, model_dir, monkeypatch):
    """Lightning builds a fit's validation loader, and with it the mean-reward metric, once: the metric was never
    reset, so every validation after the first logged the first one's reward again (``val_reward``, the paper's
    OpenThoughts figure). Here validation v scores every completion v / 10, a stand-in for a policy that learns."""
    from sgrpo.eval.evaluation import PolicyEvaluation
    from sgrpo.eval.metrics import MeanReward

    validations, start, update = [], PolicyEvaluation.on_validation_epoch_start, MeanReward.update
    monkeypatch.setattr(PolicyEvaluation, "on_validation_epoch_start",
                        lambda self: (validations.append(len(validations)), start(self))[1])  # fmt: skip
    monkeypatch.setattr(MeanReward, "update", lambda self, index, rewards: update(
        self, index, torch.full_like(rewards, validations[-1] / 10) if self in rewarded else rewards))  # fmt: skip
    loader = PolicyEvaluation._evaluation_loader
    rewarded = []

    def building(self, *args, **kwargs):
        result = loader(self, *args, **kwargs)
        rewarded.extend(self._evaluation_rewards.values())
        return result

    monkeypatch.setattr(PolicyEvaluation, "_evaluation_loader", building)
    cli = fit(tmp_path, model_dir, "--trainer.max_steps=3", "--trainer.val_check_interval=1",
              "--model.val_reward=true")  # fmt: skip
    assert [v["step"] for v in cli.model.val_history] == [1, 2, 3]
    assert [v["reward"] for v in cli.model.val_history] == pytest.approx([0.0, 0.1, 0.2])  # before: 0, 0, 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "64-true"])
def test_the_sampler_is_the_trained_policy(tmp_path, precision):
    """The shipped model (rows with rewards that vary, so the update runs) logs the gap between the rollout's
    log-probs and the trainer's on the same tokens: float noise in fp32 and fp64; under bf16-mixed, where the
    rollout runs in autocast, small, since both take the LM head in float32 (sgrpo.model.head); bf16-true likewise.
    The "-true" precisions convert each batch before any hook sees it (they failed on the prompts at step 1);
    the run validates at its end, whose batches go through the same conversion."""
    cli = fit(tmp_path, str(REPO / "sgrpo" / "assets" / "quickstart_model"), "--trainer.max_steps=2",
              f"--trainer.precision={precision}", "--trainer.val_check_interval=2")  # fmt: skip
    assert [v["step"] for v in cli.model.val_history] == [2]
    export([str(tmp_path / "checkpoints" / "last.ckpt"), str(tmp_path / "exported")])  # in the trained dtype
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["dtype"] == json.loads((tmp_path / "hf_model" / "config.json").read_text())["dtype"]
    assert config["dtype"] == {"bf16-true": "bfloat16", "64-true": "float64"}.get(precision, "float32")
    rows = [r for r in metrics(tmp_path) if r["train/rollout/mismatch_max_abs"]]
    assert rows, "no step measured the gap"
    bound = {"32-true": (1e-4, 1e-5), "64-true": (1e-4, 1e-5), "bf16-mixed": (0.1, 5e-3), "bf16-true": (0.1, 5e-3)}
    bound = bound[precision]
    for row in rows:
        assert float(row["train/rollout/mismatch_max_abs"]) < bound[0]
        assert float(row["train/rollout/mismatch_abs_diff"]) < bound[1]


def test_resume_continues_and_reproduces_the_uninterrupted_run(tmp_path, model_dir, recwarn):
    keys = ("train/reward", "train/loss", "train/grad_norm", "train/completion/length_mean")
    fit(tmp_path / "full", model_dir, "--trainer.max_steps=4", "--trainer.val_check_interval=100")
    fit(tmp_path / "cut", model_dir, "--trainer.max_steps=2", "--trainer.val_check_interval=100",
        "--checkpoint_every=1")  # fmt: skip
    fit(tmp_path / "cut", model_dir, "--trainer.max_steps=4", "--trainer.val_check_interval=100", "--ckpt_path=last")
    # Lightning's, not ours: its checkpoint callback's warnings, and torch's deprecation of the LeafSpec that
    # Lightning's CombinedLoader builds
    noise = ("Using ModelCheckpoint with manual optimization", "exists and is not empty", "treespec, LeafSpec")
    assert not [str(w.message)[:60] for w in recwarn if any(n in str(w.message) for n in noise)]
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert [int(r["step"]) for r in cut] == [0, 1, 2, 3]  # resumed at step 2 (the 3rd), not 0
    for a, b in zip(full, cut, strict=True):
        for key in keys:
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.parametrize(
    ("arg", "needle"), [("--model.grup_size=8", "grup_size"), ("--model.group_size=1", "group_size")]
)
def test_bad_config_fails_fast_naming_the_key(arg, needle, tmp_path, capfd):
    """Refused before any model loads (no mention of the model folder, which does not exist), naming the key. In
    this process, everything it writes to the file descriptors captured: as a subprocess it took 9 s, all of it
    the interpreter's imports."""
    with pytest.raises(SystemExit) as failed:
        main(["--config", TINY, arg, "--model.model=/nonexistent/model", f"--trainer.default_root_dir={tmp_path}"])
    err = capfd.readouterr().err
    assert failed.value.code != 0
    assert needle in err
    assert "/nonexistent/model" not in err  # it failed before trying to load the model


def test_a_crashed_run_saves_its_last_step_and_resumes_there(tmp_path, model_dir, monkeypatch):
    from sgrpo.policy import GRPOPolicy

    original = GRPOPolicy.training_step

    def crash_at_step_3(self, examples, batch_idx):
        if self.rollout_step == 3:
            raise RuntimeError("simulated crash")
        return original(self, examples, batch_idx)

    monkeypatch.setattr(GRPOPolicy, "training_step", crash_at_step_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path, model_dir, "--trainer.max_steps=6", "--trainer.val_check_interval=100")
    monkeypatch.setattr(GRPOPolicy, "training_step", original)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
    fit(tmp_path, model_dir, "--trainer.max_steps=5", "--trainer.val_check_interval=100", "--ckpt_path=last")
    resumed = metrics(tmp_path)
    assert [int(r["step"]) for r in resumed] == [0, 1, 2, 3, 4]  # steps 3 and 4 after the resume
    fit(tmp_path / "full", model_dir, "--trainer.max_steps=5", "--trainer.val_check_interval=100")
    for a, b in zip(metrics(tmp_path / "full"), resumed, strict=True):  # the same run as an uninterrupted one
        assert float(a["train/loss"]) == pytest.approx(float(b["train/loss"]), rel=1e-5, abs=1e-7), a["step"]
