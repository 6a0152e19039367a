"""The LLM judge (issue 23, item 3): the shipped tiny model as judge, and a stub OpenAI-compatible endpoint on
127.0.0.1 answering, failing, stalling and babbling; a failed judgement scores 0, is counted, and never hangs."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from sgrpo.types import Example
from tasks import JudgeReward, MeetingBank, Task
from tasks.judge import after_thought, read_score

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Score: 7", 0.7),
        ("I'd say 3. Final verdict, score: 8", 0.8),  # the last "Score:" wins over other numbers
        ("**Score:** 9", 0.9),
        ("7", 0.7),  # no "Score:": the last number
        ("Score: 10", 1.0),
        ("Score: 0", 0.0),
        ("Score: 11", None),  # out of [0, max_score]
        ("Score: -1", None),
        ("I cannot grade this", None),
        ("7/10", 0.7),  # out of the scale: before, the last number, 10
        ("I rate it 7 out of 10.", 0.7),
        ("Rating: 3 (on a 0-10 scale)", 0.3),  # before: -10, then 10
    ],
)
def test_read_score(reply, expected):
    assert read_score(reply, 10.0) == (None if expected is None else pytest.approx(expected))


@pytest.mark.slow  # loads a model: 5-9 s on 2 busy cores
def test_the_tiny_model_as_judge_is_deterministic_and_in_range():
    judge = JudgeReward(model=str(REPO / "sgrpo/assets/quickstart_model"), max_new_tokens=2, batch_size=2,
                        rubric="{prompt} {reference} {response} Score:")  # fmt: skip
    examples = [Example([{"role": "user", "content": "add 1 and 2"}], "3")] * 3
    first = judge.score(examples, ["3", "4", "<think>hmm</think> 3"])
    again = judge.score(examples, ["3", "4", "<think>hmm</think> 3"])
    assert first.total.tolist() == again.total.tolist()  # greedy
    assert all(0.0 <= v <= 1.0 for v in first.total.tolist())
    assert sum(first.counts.values()) == 3 and first.failures == 3 - first.counts.get("judged", 0)


class Judge(BaseHTTPRequestHandler):
    """A stub OpenAI-compatible server: its reply depends on the response it is asked to grade."""

    seen: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.seen.append((self.path, body, self.headers.get("Authorization")))
        question = body["messages"][0]["content"]
        if "STALL" in question:
            time.sleep(1.5)  # past the judge's timeout
        if "TRICKLE" in question:  # a byte every 0.3 s: each socket read is within the timeout, the reply never ends
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(20):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.3)
            return
        message = {"content": "I cannot grade this" if "BABBLE" in question else "Score: 7"}
        if "THINKER" in question:  # a server with a reasoning parser: the thought apart, the verdict as content
            message = {"content": "Score: 6", "reasoning_content": "Score: 2? No: the rhyme holds, so 9... or 6."}
        if "THINKCUT" in question:  # the same server, the thought cut off by max_tokens: no content at all
            message = {"content": None, "reasoning_content": "Score: 3 would be harsh, let me reread"}
        if "INLINE" in question:  # no parser: the thought inline, opened by the chat template in the prompt
            message = {"content": "Score: 2 is too low.</think>\n\nScore: 9"}
        payload = b"not json" if "BROKEN" in question else json.dumps({"choices": [{"message": message}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the judge gave up on this request
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Judge.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_an_endpoint_judge_scores_and_its_failures_count_without_hanging(endpoint, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "secret")
    judge = JudgeReward(url=endpoint, judge_model="stub", timeout=0.5, concurrency=4, api_key_env="JUDGE_KEY")
    example = Example([{"role": "user", "content": "Summarise the item."}], "The council approved the budget.")
    start = time.monotonic()
    completions = ["<think>x</think>The budget passed.", "STALL", "BROKEN", "BABBLE", "TRICKLE"]
    result = judge.score([example] * 5, completions)
    # the stalled request dropped at its 0.5 s timeout, the trickling one at the 0.5 x 2 waves + 1 = 2 s deadline
    assert time.monotonic() - start < 4.0  # the trickle alone lasts 6 s
    assert result.total.tolist() == pytest.approx([0.7, 0.0, 0.0, 0.0, 0.0])
    assert result.failures == 4 and result.counts == {"judged": 1, "timeout": 2, "error": 1, "unparsed": 1}
    path, body, auth = next(s for s in Judge.seen if "budget passed" in s[1]["messages"][0]["content"])
    assert (path, body["model"], body["temperature"], auth) == ("/v1/chat/completions", "stub", 0.0, "Bearer secret")
    question = body["messages"][0]["content"]
    assert "Summarise the item." in question and "The council approved the budget." in question
    assert "The budget passed." in question and "<think>" not in question  # the response without its thought


def test_a_judge_is_a_success_test_for_validate_and_test(endpoint):
    """As a reference-text task's success_metric (from a config), validation and test read the judge's verdicts."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=Task)
    judge = {"class_path": "tasks.JudgeReward", "init_args": {"url": endpoint, "timeout": 2.0}}
    settings = {"path": "tests/fixtures/meetingbank.jsonl", "test_size": 2, "success_threshold": 0.5}
    config = {"class_path": "tasks.MeetingBank", "init_args": settings | {"success_metric": judge}}
    task = parser.instantiate(parser.parse_object({"task": config})).task
    assert isinstance(task, MeetingBank) and isinstance(task.success_metric, JudgeReward)
    example = task.examples("test")[0]
    assert task.successes([example] * 2, ["A fine summary.", "BABBLE"]).tolist() == [True, False]


def test_a_judge_needs_exactly_one_of_model_and_url():
    with pytest.raises(ValueError, match="exactly one of model"):
        JudgeReward()
    with pytest.raises(ValueError, match="exactly one of model"):
        JudgeReward(model="m", url="http://127.0.0.1:1/v1")


def test_a_thinking_judge_is_read_after_its_thought_from_a_server(endpoint):
    """The paper's judge thinks (Qwen3-30B-A3B-Thinking-2507): room to think, and the verdict read after the
    thought, whether a reasoning parser split it off (reasoning_content) or it came inline before </think>; a
    thought cut off by max_tokens scores 0 as "unfinished", never as the numbers inside the thought."""
    judge = JudgeReward(url=endpoint, judge_model="stub", thinking=True, timeout=2.0, concurrency=2)
    example = Example([{"role": "user", "content": "a poem"}], "a reference poem")
    result = judge.score([example] * 4, ["THINKER", "THINKCUT", "INLINE", "plain"])
    assert result.total.tolist() == pytest.approx([0.6, 0.0, 0.9, 0.0])
    assert result.counts == {"judged": 2, "unfinished": 2} and result.failures == 2  # "plain": no thought ended
    assert {body["max_tokens"] for _, body, _ in Judge.seen} == {8192}  # room to think by default
    # a judge that does not think: 16 tokens by default, and a reply without think tags is read whole
    plain = JudgeReward(url=endpoint, judge_model="stub", timeout=2.0)
    assert plain.max_new_tokens == 16 and plain.score([example], ["plain"]).total.tolist() == [pytest.approx(0.7)]
    assert plain.score([example], ["THINKCUT"]).counts == {"unfinished": 1}  # an open <think>: cut off


def test_a_local_thinking_judge_reads_the_verdict_after_the_thought():
    """A fake local judge model (its rollout stubbed): the reply after </think> is read; a reply whose thought never
    closed (the template opened it in the prompt) is "unfinished"; the local judge gets room to think too."""

    class FakeRollout:
        replies = ["Score: 1 at first, then 8.</think>\nScore: 8", "still weighing: Score: 5 or"]

        def generate(self, model, tokenizer, examples, group_size, greedy=False):
            assert greedy and group_size == 1
            return type("Batch", (), {"completions": self.replies[: len(examples)]})()

    judge = JudgeReward(model="a-thinking-judge", thinking=True, batch_size=4)
    assert judge.max_new_tokens == 8192
    judge._judge = (None, None, FakeRollout())
    example = Example([{"role": "user", "content": "a poem"}], "a reference")
    result = judge.score([example] * 2, ["a", "b"])
    assert result.total.tolist() == pytest.approx([0.8, 0.0]) and result.counts == {"judged": 1, "unfinished": 1}


@pytest.mark.parametrize(
    ("reply", "thinking", "expected"),
    [
        ("Score: 3</think>Score: 8", True, "Score: 8"),
        ("<think>a</think>b</think>Score: 4", False, "Score: 4"),  # the last </think>
        ("Score: 3 and still thinking", True, None),
        ("<think>Score: 3 and still thinking", False, None),
        ("Score: 7", False, "Score: 7"),
    ],
)
def test_after_thought(reply, thinking, expected):
    assert after_thought(reply, thinking) == expected
