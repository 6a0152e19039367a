"""Multi-turn episodes, tokens in and tokens out (issue 37): the rows the trainer sees are what the sampler saw."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from sgrpo.model.logprobs import completion_logprobs
from sgrpo.rollout.episodes import EpisodeError, batched_turns, multi_turn_problem, render, run_episodes
from sgrpo.rollout.hf import HFRollout
from sgrpo.train.loss import BatchCounts, ClippedSurrogate, TokenBatch
from tasks.environment import Observation
from tests.multiturn_helpers import EXAMPLES, PREFIX, STRIP, Broken, Reply, chat_model, chat_tokenizer

G = 3


class Recorder:
    """``generate_rows`` of an ``HFRollout`` that records each context it was given and the tokens it sampled."""

    def __init__(self, engine: HFRollout, model, tokenizer) -> None:
        self.engine, self.model = engine, model
        self.eos, self.pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
        self.sampled: dict[tuple[int, ...], list[list[int]]] = {}

    def __call__(self, ids, mask, row_prompt, limit=None):
        tokens, logprobs, masses = self.engine._generate_rows(self.model, ids, mask, row_prompt, self.eos, self.pad,
                                                              False, limit)  # fmt: skip
        for r, u in enumerate(row_prompt.tolist()):
            context = tuple(ids[u][mask[u].bool()].tolist())
            self.sampled.setdefault(context, []).append(tokens[r].tolist())
        return tokens, logprobs, masses


def episodes(template: str, environment, seed: int = 0, max_new_tokens: int = 16):
    tokenizer = chat_tokenizer(template)
    model = chat_model(tokenizer)
    recorder = Recorder(HFRollout(max_new_tokens=max_new_tokens), model, tokenizer)
    torch.manual_seed(seed)
    with torch.inference_mode():
        turns = batched_turns(recorder, recorder.pad, torch.device("cpu"))
        batch = run_episodes(turns, tokenizer, EXAMPLES, G, environment, recorder.eos, recorder.pad,
                             torch.device("cpu"), max_positions=512, reports=recorder.engine.sampler_reports(False))
    return batch, tokenizer, model, recorder


def real_tokens(batch, row: int) -> list[int]:
    return batch.input_ids[row][batch.attention_mask[row].bool()].tolist()


def test_a_prefix_preserving_template_gives_one_row_equal_to_the_rendered_conversation():
    batch, tokenizer, _, _ = episodes(PREFIX, Reply(max_turns=3))
    assert batch.trajectory is None and batch.input_ids.shape[0] == len(EXAMPLES) * G
    assert sum(e.turns for e in batch.episodes) > len(batch.episodes)  # several turns were taken
    for row, episode in enumerate(batch.episodes):
        assert episode.forks == 0
        rendered = render(tokenizer, episode.messages, {}, generation_prompt=False)
        if batch.truncated[row]:  # the last turn was cut before its end-of-turn token, which the template adds
            rendered = rendered.removesuffix("<|im_end|>")
        assert real_tokens(batch, row) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        generated = int(batch.completion_mask[row].sum())
        observed = int(batch.attention_mask[row, batch.prompt_length :].sum()) - generated
        assert (episode.generated_tokens, episode.observation_tokens) == (generated, observed)


@pytest.mark.parametrize("template", [PREFIX, STRIP])
def test_the_loss_tokens_are_exactly_the_sampled_ids(template):
    """Each run of mask-1 tokens is what the sampler drew after exactly the tokens before it in the row."""
    batch, tokenizer, _, recorder = episodes(template, Reply(max_turns=3))
    unused = {context: list(draws) for context, draws in recorder.sampled.items()}
    p, runs = batch.prompt_length, 0
    for row in range(batch.input_ids.shape[0]):
        mask = batch.completion_mask[row].tolist()
        ids = batch.input_ids[row].tolist()
        prompt = real_tokens(batch, row)[: int(batch.attention_mask[row, :p].sum())]
        starts = [t for t, m in enumerate(mask) if m and (t == 0 or not mask[t - 1])]
        for start in starts:
            end = next((t for t in range(start, len(mask)) if not mask[t]), len(mask))
            draws = unused[tuple(prompt + ids[p : p + start])]
            run = ids[p + start : p + end]
            match = next(d for d in draws if d[: len(run)] == run)  # StopIteration: not a sampled turn
            draws.remove(match)
            assert run[-1] == tokenizer.eos_token_id or len(run) == 16 or bool(batch.truncated.any())
            runs += 1
    assert runs == sum(e.turns for e in batch.episodes)


def test_a_thinking_stripping_template_starts_a_new_row_instead_of_retokenizing():
    batch, tokenizer, _, _ = episodes(STRIP, Reply(max_turns=3))
    trajectory = batch.trajectory.tolist()
    assert trajectory == sorted(trajectory)  # a trajectory's rows are consecutive
    for i, episode in enumerate(batch.episodes):
        rows = [r for r, t in enumerate(trajectory) if t == i]
        assert episode.forks == episode.turns - 1 == len(rows) - 1 > 0  # every observation broke the prefix
        for answered, r in enumerate(rows):  # each row opens with the template's rendering of the conversation so far
            k = next(j for j, m in enumerate(episode.messages) if m["role"] == "assistant" and
                     sum(n["role"] == "assistant" for n in episode.messages[:j]) == answered)  # fmt: skip
            opening = render(tokenizer, episode.messages[:k], {})
            prompt = real_tokens(batch, r)[: int(batch.attention_mask[r, : batch.prompt_length].sum())]
            assert prompt == tokenizer(opening, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("template", [PREFIX, STRIP])
@pytest.mark.parametrize("layout", ["padded", "shared_prompts", "packed"])
def test_the_trainers_logprobs_at_loss_tokens_are_the_samplers(template, layout):
    """Observation tokens inside the completion region (attended, mask 0) in every log-prob layout."""
    tokenizer = chat_tokenizer(template)
    model = chat_model(tokenizer)
    torch.manual_seed(1)
    batch = HFRollout(max_new_tokens=16).generate_episodes(model, tokenizer, EXAMPLES, G, Reply(max_turns=3))
    assert batch.logprobs is not None and int(batch.completion_mask.sum()) > 20
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                      share_prompts=layout == "shared_prompts", packing=layout == "packed")  # fmt: skip
    mask = batch.completion_mask
    assert float((logp - batch.logprobs)[mask].abs().max()) <= 1e-5
    assert torch.all(batch.logprobs[~mask] == 0)


def test_the_loss_gradient_at_observation_tokens_is_exactly_zero():
    """Log-probs at every attended completion token (turns and observations); the loss on the loss mask."""
    tokenizer = chat_tokenizer(PREFIX)
    model = chat_model(tokenizer)
    torch.manual_seed(2)
    batch = HFRollout(max_new_tokens=16).generate_episodes(model, tokenizer, EXAMPLES, G, Reply(max_turns=3))
    attended = batch.attention_mask[:, batch.prompt_length :].bool()
    observation = attended & ~batch.completion_mask
    assert observation.any()
    logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, attended, share_prompts=False)
    logp.retain_grad()
    advantages = torch.linspace(-1, 1, batch.input_ids.shape[0])
    tokens = TokenBatch(logp, logp.detach(), advantages, batch.completion_mask)
    counts = BatchCounts(batch.input_ids.shape[0], float(batch.completion_mask.sum()), 16)
    loss, _ = ClippedSurrogate()(tokens, counts)
    loss.backward()
    assert torch.all(logp.grad[observation] == 0)
    assert torch.all(logp.grad[batch.completion_mask] != 0)
    embedding = model.get_input_embeddings().weight.grad
    observed_ids = batch.input_ids[:, batch.prompt_length :][observation].unique()
    assert embedding[observed_ids].abs().sum() > 0  # observations are attended: they shape the turns' log-probs


def test_episodes_stop_at_max_turns_and_at_the_token_budget():
    batch, _, _, _ = episodes(PREFIX, Reply(max_turns=2))
    assert max(e.turns for e in batch.episodes) == 2
    assert all(e.rewards == [0.25] * e.turns or batch.truncated[i] for i, e in enumerate(batch.episodes))
    budget, _, _, _ = episodes(PREFIX, Reply(max_turns=8, max_episode_tokens=20))
    for i, e in enumerate(budget.episodes):
        assert e.generated_tokens + e.observation_tokens <= 20
        row_tokens = int(budget.attention_mask[i, budget.prompt_length :].sum())
        assert row_tokens == e.generated_tokens + e.observation_tokens
    assert budget.truncated.any()


def test_an_environment_that_raises_fails_the_step_naming_it():
    with pytest.raises(EpisodeError, match=r"environment Broken failed in step\(\): KeyError: 'no such state'"):
        episodes(PREFIX, Broken())


class Briefs(Reply):
    """Answers every turn with a system message, which many chat templates refuse after the first message."""

    def step(self, example, messages) -> Observation:
        return Observation([{"role": "system", "content": "go on"}])


def test_a_chat_template_that_refuses_a_conversation_mid_episode_fails_the_step_naming_the_environment():
    """The template raised inside the episode loop (a system message after the opening): a bare jinja error escaped
    the step, naming neither the environment nor the fix. It is an ``EpisodeError`` now, as an environment's own."""
    check = "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('System message must be at the " \
            "beginning.') }}{% endif %}"
    refuses = PREFIX.replace("{% for m in messages %}", "{% for m in messages %}" + check)
    with pytest.raises(EpisodeError, match=r"the chat template cannot render environment Briefs's conversation after "
                                           r"turn 1 \(TemplateError: System message must be at the beginning.\)"):
        episodes(refuses, Briefs(max_turns=3))


@pytest.mark.parametrize(
    "answer, problem",
    [
        ("go on", "returned str, not an Observation"),
        (Observation([{"role": "user"}]), "returned the message {'role': 'user'}, not a dict with text role"),
        (Observation([], reward=float("nan")), "returned the reward nan, not a finite number or None"),
        (Observation([{"role": "user", "content": "a\ud800"}]),  # the tokenizer raised a bare TypeError on it
         "returned a message whose content is not UTF-8 text (surrogates not allowed at character 1)"),
    ],
)
def test_an_environment_that_answers_wrongly_fails_the_step_naming_it(answer, problem):
    wrong = type("Wrong", (Reply,), {"step": lambda self, example, messages: answer})()
    with pytest.raises(EpisodeError, match=f"environment Wrong {re.escape(problem)}"):
        episodes(PREFIX, wrong)


def test_an_environment_that_answers_a_round_with_too_few_observations_fails_the_step_naming_it():
    short = type("Short", (Reply,), {"steps": lambda self, turns: turns[1:]})()  # answers a round together, wrongly
    with pytest.raises(EpisodeError, match=r"environment Short returned \d+ observations from steps\(\) for \d+ turns"):
        episodes(PREFIX, short)
    counted = type("Counted", (Reply,), {"steps": 3})()  # an attribute of its own named steps, not a method
    assert len(episodes(PREFIX, counted)) == len(episodes(PREFIX, Reply()))


def test_a_template_unusable_for_multi_turn_is_refused():
    loop = "{% for m in messages %}"
    refuse = "{% if m['role'] == 'tool' %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    refuses_tools = PREFIX.replace(loop, loop + refuse)
    assert multi_turn_problem(chat_tokenizer(PREFIX), Reply()) is None
    assert multi_turn_problem(chat_tokenizer(STRIP), Reply()) is None
    tool_env = type("T", (Reply,), {"observation_role": "tool"})()
    problem = multi_turn_problem(chat_tokenizer(refuses_tools), tool_env)
    assert "cannot render a 'tool' message after an assistant turn" in problem and "alternate" in problem
    assert "no chat template" in multi_turn_problem(chat_tokenizer(None), Reply())
    drops = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    assert "drops the assistant turn" in multi_turn_problem(chat_tokenizer(drops), Reply())


class Waiting(Reply):
    """A step that waits (a tool calling out) and counts how many run at once."""

    def __init__(self, concurrent_steps: int) -> None:
        super().__init__(max_turns=2)
        self.concurrent_steps, self.running, self.most = concurrent_steps, 0, 0
        self.lock = threading.Lock()

    def step(self, example, messages):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.05)
        with self.lock:
            self.running -= 1
        return super().step(example, messages)


def test_concurrent_steps_run_in_threads_and_give_the_same_episodes():
    alone, _, _, _ = episodes(PREFIX, sequential := Waiting(1))
    together, _, _, _ = episodes(PREFIX, concurrent := Waiting(4))
    assert sequential.most == 1 and concurrent.most > 1
    assert torch.equal(alone.input_ids, together.input_ids) and alone.episodes == together.episodes


@pytest.mark.parametrize("decoder", ["lean", "generate"])
def test_a_turn_near_the_model_s_positions_is_decoded_within_them(decoder):
    """A context with less room than ``max_new_tokens`` is decoded only as far as the model's positions go: a
    learned-position model (GPT-2, 64 positions) used to index past its table (IndexError; on CUDA a device assert);
    the turn is cut at the room and the episode ends truncated."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = chat_tokenizer(PREFIX)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = GPT2LMHeadModel(config).eval()
    batch = HFRollout(max_new_tokens=40, decoder=decoder).generate_episodes(model, tokenizer, EXAMPLES, 2,
                                                                             Reply(max_turns=4))  # fmt: skip
    assert batch.attention_mask.sum(-1).max() <= 64 and bool(batch.truncated.all())


@pytest.mark.parametrize("settings, fields", [
    ({"decoder": "lean"}, (True, False)),
    ({"decoder": "lean", "top_p": 0.9}, (True, True)),
    ({"decoder": "generate"}, (False, False)),
])  # fmt: skip
def test_a_batch_carries_the_engines_fields_whether_or_not_its_episodes_sampled(settings, fields):
    """(log-probs, nucleus masses) present as the engine reports them, also where no episode took a turn (every
    opening beyond the model's positions). Such a batch carried both as zeros whatever the engine: beside a process
    whose episodes sampled, the processes differed in their fields, and the collectives on them (the nucleus mass's
    sum, ``balance_batch``'s exchange, the sampler gap's reduce) no longer paired up."""
    tokenizer = chat_tokenizer(PREFIX)
    model = chat_model(tokenizer)
    engine = HFRollout(max_new_tokens=4, **settings)
    present = lambda batch: (batch.logprobs is not None, batch.nucleus_mass is not None)  # noqa: E731
    torch.manual_seed(0)
    sampled = engine.generate_episodes(model, tokenizer, EXAMPLES, G, Reply(max_turns=1))
    model.config.max_position_embeddings = 8  # shorter than every opening: the episodes end before a turn
    unsampled = engine.generate_episodes(model, tokenizer, EXAMPLES, G, Reply(max_turns=1))
    assert all(e.turns == 1 for e in sampled.episodes) and all(e.turns == 0 for e in unsampled.episodes)
    assert present(sampled) == present(unsampled) == fields


#: Qwen3's rule: an assistant turn keeps its thinking while no user message follows it, and loses it once one does
QWEN3_LIKE = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
    "loop.index0 < ns.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_fork_counts_the_observation_even_where_the_template_drops_the_turn_s_thinking():
    """After a fork the observation's tokens were the new rendering's length less the old one's: with the thinking
    dropped from the old turn that difference was 0, so max_episode_tokens was overrun and tokens/observation read 0."""
    tokenizer = chat_tokenizer(QWEN3_LIKE)
    eos = [tokenizer.eos_token_id]
    turn = tokenizer("<think>" + "abcdefgh" * 5 + "</think>ok", add_special_tokens=False)["input_ids"] + eos

    def sample(contexts):
        return [(turn, [0.0] * len(turn), None) for _ in contexts]

    batch = run_episodes(sample, tokenizer, EXAMPLES[:1], 1, Reply(max_turns=3), eos, tokenizer.pad_token_id,
                         torch.device("cpu"), max_positions=None, reports=(True, False))  # fmt: skip
    (episode,) = batch.episodes
    contents = len(tokenizer("go on 1", add_special_tokens=False)["input_ids"]) * 2  # "go on 1", "go on 2"
    assert episode.turns == 3 and episode.forks == 2 and episode.observation_tokens >= contents
