"""Training on multi-turn episodes: the policy's ``environment``, per-row advantages through the trajectory index,
forked rows through dynamic sampling, and what a step logs (issue 37)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from estimators import GRPO
from sgrpo.model.logprobs import position_ids_from_mask
from sgrpo.model.tiny import build_tiny_llama, ensure_tiny_model
from sgrpo.rollout import HFRollout, RolloutEngine
from sgrpo.train.loss import ClippedSurrogate
from sgrpo.types import Episode, RolloutBatch
from tasks.base import Reward, RewardResult, Task
from tests.engine_helpers import GradCapture, run_steps
from tests.multiturn_helpers import EXAMPLES, STRIP, Broken, Reply, chat_tokenizer

G, MAX_NEW = 3, 24


class Length(Reward):
    """The final answer's length over 10, at most 1."""

    name = "length"

    def score(self, examples, completions) -> RewardResult:
        total = torch.tensor([min(len(c), 10) / 10 for c in completions])
        return RewardResult(total, {self.name: total})


class ChatTask(Task):
    def __init__(self) -> None:
        super().__init__(Length())

    def load(self, split):
        return EXAMPLES

    def success(self, example, completion) -> bool:
        return completion == example.answer


class FixedEpisodes(RolloutEngine):
    """Replays one multi-turn batch."""

    runs_episodes = True

    def __init__(self, batch: RolloutBatch) -> None:
        self.batch, self.max_new_tokens, self.temperature = batch, MAX_NEW, 1.0

    def generate(self, model, tokenizer, examples, group_size, greedy=False):
        raise AssertionError("a policy with an environment samples episodes")

    def generate_episodes(self, model, tokenizer, examples, group_size, environment, greedy=False):
        assert isinstance(environment, Reply) and group_size == G
        return self.batch


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat")
    tokenizer = chat_tokenizer(STRIP)
    build_tiny_llama(tokenizer, hidden_size=32, max_positions=512).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def forked(chat_dir) -> RolloutBatch:
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    torch.manual_seed(2)
    batch = HFRollout(max_new_tokens=MAX_NEW).generate_episodes(model, tokenizer, EXAMPLES, G, Reply(max_turns=3))
    assert batch.trajectory is not None and batch.input_ids.shape[0] > len(batch.completions)  # rows forked
    return batch


@pytest.mark.parametrize("aggregation", ["seq_sum_const", "seq_mean_token_mean"])
def test_the_update_gives_each_row_its_trajectorys_advantage(chat_dir, forked, tmp_path, aggregation):
    """At ratio 1 a trajectory is one sequence, its rows sharing its advantage A_j (sgrpo.train.sequences):
    seq_sum_const: grad = -sum_rows A_j(row) grad log pi(row's turns) / (B L), B trajectories, L = max_turns x
    max_new_tokens; seq_mean_token_mean: the same sum with each row over |o_j(row)| (its trajectory's loss tokens
    over all its rows) instead of L. The environment's per-turn rewards add to the task's."""
    policy = GradCapture(str(chat_dir), ChatTask(), GRPO(), FixedEpisodes(forked), group_size=G, prompts_per_step=2,
                         loss=ClippedSurrogate(aggregation=aggregation), max_grad_norm=None,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.0), environment=Reply(max_turns=3),
                         log_completions_every=1)  # fmt: skip
    trainer = run_steps(policy, root=tmp_path)
    got = torch.cat([g.flatten() for _, g in sorted(policy.captured[0].items())])

    task = torch.tensor([min(len(c), 10) / 10 for c in forked.completions])
    rewards = task + torch.tensor([e.reward for e in forked.episodes])  # 0.25 per answered turn
    advantages = forked.per_row(GRPO()(rewards.view(-1, G)).reshape(-1))  # [N'] each row its trajectory's
    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    p = forked.prompt_length
    logits = model(input_ids=forked.input_ids, attention_mask=forked.attention_mask,
                   position_ids=position_ids_from_mask(forked.attention_mask)).logits[:, p - 1 : -1]  # fmt: skip
    token_logp = logits.log_softmax(-1).gather(-1, forked.input_ids[:, p:].unsqueeze(-1)).squeeze(-1)
    row_logp = (token_logp * forked.completion_mask).sum(-1)  # observation tokens: attended, not in the loss
    lengths = forked.completion_mask.sum(-1).float()  # [N'] each row's loss tokens
    carry = lengths > 0
    trajectories = len(set(forked.trajectory[carry].tolist()))  # B: trajectories, not rows (forked: fewer)
    assert trajectories < int(carry.sum())
    per_trajectory = torch.zeros(len(forked.completions)).index_add_(0, forked.trajectory, lengths)
    # seq_sum_const: L = max_turns (Reply(max_turns=3)) x max_new_tokens; else |o_j|, the trajectory's tokens
    constant = aggregation == "seq_sum_const"
    scale = torch.full_like(lengths, 3 * MAX_NEW) if constant else forked.per_row(per_trajectory)
    (-(advantages * row_logp / scale.clamp_min(1)).sum() / trajectories).backward()
    want = torch.cat([q.grad.flatten() for _, q in sorted(model.named_parameters())])
    assert float((got - want).norm() / want.norm()) < 1e-6

    metrics = trainer.callback_metrics
    turns = sum(e.turns for e in forked.episodes) / len(forked.episodes)
    assert float(metrics["train/episode/turns"]) == pytest.approx(turns)
    assert float(metrics["train/episode/forks"]) == pytest.approx(turns - 1)
    assert float(metrics["train/reward"]) == pytest.approx(float(rewards.mean()))
    assert {"train/episode/tool_calls", "train/episode/tool_failures", "train/episode/tokens/generated",
            "train/episode/tokens/observation", "train/episode/tool_use_rate"} <= set(metrics)  # fmt: skip
    lines = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * G and lines[0]["prompt"].startswith("user\nadd 12 and 30")
    episode = lines[0]["episode"]
    assert episode["messages"] == forked.episodes[0].messages and episode["forks"] == forked.episodes[0].forks
    assert episode["turn_rewards"] == [0.25] * len(episode["turn_rewards"])


def test_validation_logs_the_means_of_its_episodes(chat_dir, forked, tmp_path):
    """val/episode/*: each quantity's mean over the validation's episodes (tool use rate, turns, forks, ...)."""
    from sgrpo.eval.metrics import EPISODE_METRICS, episode_values
    from sgrpo.policy import GRPOPolicy

    policy = GRPOPolicy(str(chat_dir), ChatTask(), GRPO(), FixedEpisodes(forked), group_size=G, prompts_per_step=2,
                        val_samples=G, environment=Reply(max_turns=3), optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                        val_reward=True)  # fmt: skip
    metrics = run_steps(policy, root=tmp_path, limit_val_batches=1, val_check_interval=1).callback_metrics
    values = episode_values(forked.episodes)
    assert set(values) == set(EPISODE_METRICS) and max(values["forks"]) > 0
    for key, per_episode in values.items():
        assert float(metrics[f"val/episode/{key}"]) == pytest.approx(sum(per_episode) / len(per_episode)), key
    # val/reward is the training reward: the task's and the environment's per-turn rewards (left out before)
    task_rewards = Length().score([None] * len(forked.completions), forked.completions).total
    trained = task_rewards + torch.tensor([e.reward for e in forked.episodes])
    assert max(e.reward for e in forked.episodes) > 0
    assert float(metrics["val/reward"]) == pytest.approx(float(trained.double().mean()))


def test_select_groups_and_cat_carry_forked_rows(forked):
    two = RolloutBatch.cat([forked, forked])
    assert two.trajectory.tolist() == forked.trajectory.tolist() + (forked.trajectory + 2 * G).tolist()
    picked = two.select_groups(torch.tensor([3, 0]))  # group 3 is group 1 of the second copy
    mine = forked.select_groups(torch.tensor([1, 0]))
    assert torch.equal(picked.input_ids, mine.input_ids) and torch.equal(picked.trajectory, mine.trajectory)
    rows_of_group_1 = (forked.trajectory >= G).sum()
    assert torch.equal(mine.input_ids[:rows_of_group_1], forked.input_ids[forked.trajectory >= G])
    assert mine.completions == forked.completions[G:] + forked.completions[:G]
    assert mine.episodes == forked.episodes[G:] + forked.episodes[:G]
    assert mine.trajectory.tolist() == sorted(mine.trajectory.tolist())


def test_a_batch_checks_its_trajectory_index():
    ids = torch.zeros(3, 4, dtype=torch.long)
    mask = torch.ones(3, 2, dtype=torch.bool)
    fields = dict(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=mask, completions=["a", "b"],
                  truncated=torch.zeros(2, dtype=torch.bool), group_size=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"3 rows for 2 trajectories need a trajectory index \[3\]"):
        RolloutBatch(**fields)
    batch = RolloutBatch(**fields, trajectory=torch.tensor([0, 0, 1]), episodes=[Episode([]), Episode([])])
    assert batch.num_groups == 1 and batch.per_row(torch.tensor([5.0, 7.0])).tolist() == [5.0, 5.0, 7.0]


def test_a_policy_refuses_an_environment_its_template_or_engine_cannot_run(tmp_path):
    plain = ensure_tiny_model(tmp_path / "plain")  # a character model without a chat template
    policy = GradCapture(str(plain), ChatTask(), GRPO(), group_size=G, environment=Reply())
    with pytest.raises(ValueError) as err:
        policy.configure_model()
    assert str(err.value).count("\n") == 0 and policy.model is None  # refused before the weights load
    assert str(err.value).startswith("model.environment: Reply needs a multi-turn chat template, but ")
    assert "the tokenizer has no chat template" in str(err.value)
    single = type("Single", (RolloutEngine,), {"generate": lambda *a, **k: None, "max_new_tokens": 4,
                                               "temperature": 1.0})()  # fmt: skip
    with pytest.raises(ValueError, match="model.rollout: Single does not run multi-turn episodes"):
        GradCapture(str(plain), ChatTask(), GRPO(), rollout=single, group_size=G, environment=Reply())


def test_an_environment_that_raises_stops_the_step_naming_it(chat_dir):
    from sgrpo.run.guards import EnvironmentFailure

    policy = GradCapture(str(chat_dir), ChatTask(), GRPO(), HFRollout(max_new_tokens=4), group_size=G,
                         prompts_per_step=2, environment=Broken())  # fmt: skip
    with pytest.raises(EnvironmentFailure, match=r"environment Broken failed in step\(\): KeyError"):
        run_steps(policy)


class ChatSynthetic(Task):
    """Chat prompts for a config test: the synthetic task's settings, messages instead of raw text."""

    def __init__(self, **settings) -> None:
        super().__init__(Length(), **settings)

    def load(self, split):
        return EXAMPLES * 2

    def success(self, example, completion) -> bool:
        return completion == example.answer


def tool_config(chat_dir: Path, tmp_path: Path, **model) -> Path:
    """docs/environments.md's config form: ChatSynthetic with a ToolEnvironment of one tool, a 1-step fit."""
    import yaml

    config = {
        "model": {
            "model": str(chat_dir),
            "task": {"class_path": "tests.test_episodes_training.ChatSynthetic"},
            "estimator": {"class_path": "estimators.GRPO"},
            "rollout": {"class_path": "sgrpo.rollout.HFRollout", "init_args": {"max_new_tokens": 8}},
            "environment": {"class_path": "tasks.environment.ToolEnvironment",
                            "init_args": {"tools": ["tests.test_tools.multiply"], "max_turns": 2}},
            "group_size": 2, "prompts_per_step": 2, "val_samples": 1, **model,
        },
        "trainer": {"accelerator": "cpu", "max_steps": 1, "default_root_dir": str(tmp_path / "run"),
                    "logger": False, "val_check_interval": 1, "limit_val_batches": 1},
        "seed_everything": 0,
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_environment_and_its_tools_plug_in_by_class_path_and_train(chat_dir, tmp_path):
    """The config form of docs/environments.md, through sgrpo.fit: parsed, checked, one training step."""
    from sgrpo.fit import main, parse
    from tasks.environment import ToolEnvironment
    from tests.test_tools import multiply

    path = tool_config(chat_dir, tmp_path)
    environment = parse(["--config", str(path)]).model.environment
    assert isinstance(environment, ToolEnvironment) and environment.tools == {"multiply": multiply}
    assert environment.max_turns == 2
    main(["fit", "--config", str(path)])
    assert (tmp_path / "run" / "hf_model" / "config.json").is_file()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/accuracy" in row for row in logged)  # validation ran episodes too
    assert any("train/episode/tool_calls" in row for row in logged)
    rates = [row["val/episode/tool_use_rate"] for row in logged if "val/episode/tool_use_rate" in row]
    assert rates and all(0 <= rate <= 1 for rate in rates)  # the fit's own validation logs the tool-use rate


def test_the_prompt_screen_measures_the_episode_opening_with_the_tools_message(chat_dir, tmp_path, monkeypatch, capsys):
    """A limit every prompt fits alone but no opening does (the tools' system message; a raw prompt through the
    chat template): refused in one line before the weights load. Before, the screen measured the prompt alone, so
    every opening passed and each episode started beyond the limit."""
    import sgrpo.policy_model
    from sgrpo.fit import main
    from sgrpo.rollout.engine import render_prompt
    from sgrpo.rollout.episodes import opening_text
    from tasks.environment import ToolEnvironment
    from tests.test_tools import multiply

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    environment = ToolEnvironment([multiply])
    environment.adapt_to_tokenizer(tokenizer)

    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompts = [tokens(render_prompt(tokenizer, ex.prompt, ex.chat_template_kwargs)) for ex in EXAMPLES]
    openings = [tokens(opening_text(tokenizer, ex, environment)) for ex in EXAMPLES]
    limit = max(prompts)
    assert min(openings) > limit  # the tools' system message alone is longer than the prompts
    monkeypatch.setattr(sgrpo.policy_model, "load_causal_lm", lambda *a: pytest.fail("the weights loaded"))
    with pytest.raises(SystemExit) as refused:
        main(["fit", "--config", str(tool_config(chat_dir, tmp_path, max_prompt_tokens=limit))])
    assert refused.value.code == 2
    assert "every train prompt (an episode opening: the environment adds to it) is longer than the prompt limit, " \
           f"{limit} tokens" in capsys.readouterr().err


def test_padded_micro_batches_budget_the_observation_tokens_between_turns():
    """A multi-turn row runs its observations too: the padded micro-batches' token budget counts the columns up to
    each row's last loss token, not its loss tokens alone (which would overfill every micro-batch)."""
    from sgrpo.train.batching import completion_spans, trim, update_micro_batches
    from tests.multiturn_helpers import PREFIX, chat_model

    tokenizer = chat_tokenizer(PREFIX)
    torch.manual_seed(0)
    forked = HFRollout(max_new_tokens=16).generate_episodes(chat_model(tokenizer), tokenizer, EXAMPLES, G,
                                                            Reply(max_turns=3))  # fmt: skip
    mask = forked.completion_mask
    rows = torch.arange(mask.shape[0])
    spans = completion_spans(mask)
    assert torch.all(spans >= mask.sum(-1)) and torch.any(spans > mask.sum(-1))  # observations between turns
    prefix = torch.arange(6).unsqueeze(0) < torch.tensor([[0], [3], [6]])
    assert completion_spans(prefix).tolist() == prefix.sum(-1).tolist()  # single-turn: the loss tokens
    budget = (forked.prompt_length + int(spans.max())) * 2  # two of the widest rows
    chunks = update_micro_batches(forked, rows, mask, False, None, None, budget)
    for chunk in chunks:
        ran = trim(forked, chunk, mask)["input_ids"]
        assert len(chunk) == 1 or ran.shape[0] * ran.shape[1] <= budget


class SeenRejections(ClippedSurrogate):
    """Keeps, for each micro-batch, its rows' trajectory statistics, shift (delta per token) and kept flags."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def importance(self, batch):
        weights = super().importance(batch)
        shift = ((batch.old_logp - batch.sampler_logp) * batch.mask).sum(-1) / batch.mask.sum(-1).clamp_min(1)
        self.seen.append((batch.sequence_sums, shift, weights.keep.any(-1), batch.mask.any(-1)))
        return weights


class ExternalEpisodes(FixedEpisodes):
    """Replays one multi-turn batch as an engine with weights and kernels of its own (vLLM) delivers it."""

    samples_from_policy = False


def test_a_forked_trajectory_is_kept_or_rejected_whole_by_a_sequence_correction(chat_dir, forked, tmp_path):
    """Episodes from an external sampler (vLLM's own kernels), each trajectory j's sampler log-probs the trainer's less
    c_j per token, so its sequence ratio is e^(c_j |o_j|) over all its rows. ``SequenceMask(1, e^0.8)`` keeps a
    trajectory whole or drops it whole by that sum; each row used to be judged by its own tokens, so a trajectory
    over the band whose rows each fit was kept. Every micro-batch sees its rows' trajectory sums."""
    from sgrpo.train.correction import SequenceMask

    model = AutoModelForCausalLM.from_pretrained(chat_dir)
    p = forked.prompt_length
    with torch.no_grad():
        logits = model(input_ids=forked.input_ids, attention_mask=forked.attention_mask,
                       position_ids=position_ids_from_mask(forked.attention_mask)).logits[:, p - 1 : -1]  # fmt: skip
    trainer_logp = logits.log_softmax(-1).gather(-1, forked.input_ids[:, p:].unsqueeze(-1)).squeeze(-1)
    lengths = forked.completion_mask.sum(-1).float()  # [N'] each row's loss tokens
    tokens = torch.zeros(len(forked.completions)).index_add_(0, forked.trajectory, lengths)  # |o_j|
    shift = 0.8 / tokens.clamp_min(1) * torch.linspace(0.6, 1.6, len(tokens))  # c_j: sums 0.48 .. 1.28 around 0.8
    rows_shift = forked.per_row(shift)  # [N'] each row its trajectory's c_j
    behaviour = (trainer_logp - rows_shift.unsqueeze(-1)) * forked.completion_mask
    sampled = dataclasses.replace(forked, logprobs=behaviour)
    loss = SeenRejections(corrections=[SequenceMask(1.0, 2.2255409)])  # e^0.8
    policy = GradCapture(str(chat_dir), ChatTask(), GRPO(), ExternalEpisodes(sampled), group_size=G, prompts_per_step=2,
                         loss=loss, max_grad_norm=None, optimizer=lambda q: torch.optim.SGD(q, lr=0.0),
                         environment=Reply(max_turns=3))  # fmt: skip
    run_steps(policy, root=tmp_path)
    row_sums = (rows_shift * lengths).tolist()
    whole = (shift * tokens).tolist()
    # the test tells the two apart: some trajectory is over the band while each of its rows fits
    assert any(whole[j] > 0.8 and all(row_sums[r] <= 0.8 for r in range(len(row_sums)) if forked.trajectory[r] == j)
               for j in range(len(whole)))  # fmt: skip
    assert loss.seen
    for sums, row_shift, kept, loss_rows in loss.seen:
        assert sums is not None  # the trajectory sums reached the loss
        total = sums[:, 0]
        assert torch.allclose(total, row_shift * sums[:, 2], atol=1e-4)  # c_j x |o_j|: the trajectory's, not the row's
        assert torch.equal(kept[loss_rows], ((total >= 0) & (total <= 0.8))[loss_rows])
