"""Multi-turn tool-use episodes through ``VLLMServerRollout`` (``sgrpo.rollout.vllm_server_episodes``): against the
stand-in servers of ``tests/fake_vllm_server.py`` in ``make test`` (requests, routing, tokens in and out), and
against a real ``vllm serve`` on CPU in ``make test-vllm`` (the sampler's log-probs are the trainer's)."""

from __future__ import annotations

import pytest
import torch

from sgrpo.model.tiny import build_chat_tokenizer, build_tiny_llama
from sgrpo.rollout.vllm_http import ServerError
from sgrpo.rollout.vllm_server import GENERATE, VLLMServerRollout
from sgrpo.types import Example
from tasks.calculator import add, mul
from tasks.environment import ToolEnvironment
from tests.fake_vllm_server import FakeServer

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
EXAMPLES = [Example([{"role": "user", "content": q}], a) for q, a in [("2+3", "5"), ("7*6", "42"), ("1+1", "2"),
                                                                      ("9*9", "81")]]


@pytest.fixture
def chat():
    tokenizer = build_chat_tokenizer()
    torch.manual_seed(0)
    return build_tiny_llama(tokenizer, num_heads=2, max_positions=256), tokenizer


def tools(max_turns: int = 3) -> ToolEnvironment:
    return ToolEnvironment([add, mul], max_turns=max_turns)


def test_server_episodes_send_each_row_s_ids_keep_the_server_s_tokens_and_pin_an_episode_to_one_server(chat):
    model, tokenizer = chat
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    servers = [FakeServer(completion=call), FakeServer(completion=call)]
    try:
        engine = VLLMServerRollout(urls=[s.url for s in servers], max_new_tokens=64, dtype="float32")
        environment = tools()
        environment.adapt_to_tokenizer(tokenizer)
        torch.manual_seed(0)
        batch = engine.generate_episodes(model, tokenizer, EXAMPLES, 1, environment)
    finally:
        for s in servers:
            s.stop()
    episodes = batch.episodes
    assert [e.turns for e in episodes] == [3] * 4 and [e.tool_calls for e in episodes] == [2] * 4
    assert all(e.tool_failures == 0 for e in episodes) and batch.trajectory is None  # one row each: no fork
    requests = {s.url: [body for p, body in s.calls if p == GENERATE] for s in servers}
    assert sum(map(len, requests.values())) == 12  # 4 episodes x 3 turns, one sample each
    for row in range(4):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        completion = batch.input_ids[row, batch.prompt_length :]
        generated = completion[batch.completion_mask[row]].tolist()
        assert generated == call * 3  # mask 1: exactly the servers' ids, three turns of them
        assert torch.equal(batch.logprobs[row][batch.completion_mask[row]], torch.full((len(call) * 3,), -0.5))
        # tokens in: each turn's request is a prefix of the row, all of an episode's turns on one server
        own = {url: [r for r in rs if ids[: len(r["token_ids"])] == r["token_ids"]] for url, rs in requests.items()}
        assert sorted(len(rs) for rs in own.values()) == [0, 3], own.keys()
        rendered = tokenizer.apply_chat_template(episodes[row].messages, tokenize=False, tools=environment.schemas)
        assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]  # the rendered conversation
    assert all(rs for rs in requests.values())  # the first turns spread over both servers
    assert "5" in episodes[0].messages[-2]["content"]  # the tool ran: add(2, 3)
    for body in (b for rs in requests.values() for b in rs):
        params = body["sampling_params"]
        assert params["n"] == 1 and params["seed"] is not None and params["max_tokens"] <= 64
        assert len(body["token_ids"]) + params["max_tokens"] <= 256  # never past the model's positions


def test_a_turn_from_other_weights_raises_naming_the_server(chat):
    model, tokenizer = chat
    server = FakeServer(completion=[tokenizer.eos_token_id])
    try:
        engine = VLLMServerRollout(urls=[server.url], max_new_tokens=8, dtype="float32")
        environment = tools()
        environment.adapt_to_tokenizer(tokenizer)
        engine.generate_episodes(model, tokenizer, EXAMPLES[:1], 1, environment)  # pushes, then runs
        engine._pushed = "sgrpo-other-1"  # as if the server held other weights than the trainer pushed
        server.version = "sgrpo-unknown"
        engine.ready = lambda model: None  # the check under test is the turn's, not the health check's
        with pytest.raises(ServerError, match=f"{server.url}: sampled a turn with weight versions"):
            engine.generate_episodes(model, tokenizer, EXAMPLES[:1], 1, environment)
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- a real server
def prefix_cache_hits(url: str) -> float:
    """The server's prefix-cache hits in tokens (vLLM's Prometheus counter), 0 where it exports none."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))  # fmt: skip


@pytest.mark.vllm
def test_real_server_episodes_keep_the_servers_tokens_and_logprobs(tmp_path):
    """``vllm serve`` on CPU (make test-vllm), the tiny char Llama with a multi-turn template: the loss tokens are
    exactly the ids the server sampled, with its log-probs within 1e-4 of the trainer's after each of two pushes of
    different weights (a push clears the prefix cache: no turn reuses the other weights' KV), and later turns hit the
    prefix cache (the earlier turns' KV)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from sgrpo.model.logprobs import completion_logprobs
    from sgrpo.model.tiny import build_char_tokenizer
    from sgrpo.rollout.engine import bump_weights_version
    from sgrpo.rollout.vllm_launch import VLLMServers
    from tests.multiturn_helpers import DIGITS_TEMPLATE, Digits
    from tests.vllm_server_helpers import SERVER_ARGS, free_port, perturbed

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = DIGITS_TEMPLATE
    build_tiny_llama(tokenizer, num_heads=2, max_positions=128).save_pretrained(tmp_path)  # head_dim 32 for vLLM
    tokenizer.save_pretrained(tmp_path)
    # --block-size 32 (the CPU default is 128): the cache shares whole blocks, and these rows are short
    launch = VLLMServers(ports=[free_port()], args=[*SERVER_ARGS, "--block-size", "32"], startup_timeout=600,
                         env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, log_dir=str(tmp_path))  # fmt: skip
    engine = VLLMServerRollout(launch=launch, max_new_tokens=8, dtype="float32", max_model_len=128,
                               sync_timeout=60)  # fmt: skip
    digits = torch.randint(10, (16, 40), generator=torch.Generator().manual_seed(0)).tolist()
    # 16 distinct openings of 43 tokens, one episode each: a prefix-cache hit is a later turn reusing an earlier one's
    examples = [Example(prompt="s:" + "".join(map(str, row)) + "=", answer="") for row in digits]
    sampled: list[list[int]] = []
    original_map = engine.pool.map

    def recording_map(path, payloads, **kwargs):
        answers = original_map(path, payloads, **kwargs)
        sampled.extend(a.body["choices"][0]["token_ids"] for a in answers if path == GENERATE)
        return answers

    engine.pool.map = recording_map
    try:
        for seed in (3, 4):  # two pushes of different weights
            model = perturbed(AutoModelForCausalLM.from_pretrained(tmp_path), seed)
            bump_weights_version(model)
            sampled.clear()
            hits = prefix_cache_hits(launch.urls[0]) if launch.processes else 0.0
            torch.manual_seed(seed)
            batch = engine.generate_episodes(model, tokenizer, examples, 1, Digits(max_turns=3))
            turns = [e.turns for e in batch.episodes]
            assert max(turns) > 1 and len(sampled) == sum(turns)  # one request per turn
            for row in range(batch.input_ids.shape[0]):  # mask 1: exactly what the server sampled, turn by turn
                generated = batch.input_ids[row, batch.prompt_length :][batch.completion_mask[row]].tolist()
                cut = [i + 1 for i, token in enumerate(generated) if token == tokenizer.eos_token_id]
                pieces = [generated[a:b] for a, b in zip([0, *cut], [*cut, len(generated)]) if b > a]
                assert all(any(s[: len(piece)] == piece for s in sampled) for piece in pieces)
            with torch.no_grad():
                logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
            mask = batch.completion_mask
            gap = float((logp - batch.logprobs)[mask].abs().max())
            assert gap <= 1e-4, gap
            reused = prefix_cache_hits(launch.urls[0]) - hits
            print(f"\n[figures] push {seed}: {len(turns)} episodes, {sum(turns)} turns, {int(mask.sum())} loss tokens, "
                  f"max |d log p| {gap:.2e}, prefix-cache hits {reused:.0f} tokens")
            assert reused > 0  # later turns reuse the earlier turns' KV
    finally:
        engine.close()


def test_a_turn_answered_without_log_probs_is_refused_naming_the_server():
    """The request asks for the sampled tokens' log-probs; an answer without them was a turn with none, and a batch
    whose fields depended on what each process's servers sent (the collectives on them would not pair up)."""
    from sgrpo.rollout.vllm_http import Answer
    from sgrpo.rollout.vllm_server_episodes import _turn

    content = [{"token_id": 5, "logprob": -0.5}, {"token_id": 2, "logprob": -1.0}]
    with_them = Answer("http://a:8000", {"choices": [{"token_ids": [5, 2], "logprobs": {"content": content}}]})
    assert _turn(with_them, None) == ([5, 2], [-0.5, -1.0], None)
    with pytest.raises(ServerError, match=r"http://b:8000: answered without the sampled tokens' log-probs"):
        _turn(Answer("http://b:8000", {"choices": [{"token_ids": [5, 2]}]}), None)
