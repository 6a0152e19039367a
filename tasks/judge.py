"""An LLM judge: a model grades each completion with a rubric prompt into a score in [0, 1].

The SoftmaxGRPO paper scores Poetry and MeetingBank this way, with Qwen/Qwen3-30B-A3B-Thinking-2507 and a rubric
per task: a thinking judge (``thinking: true``), whose score is read after its thought. The judge is a local
Hugging Face model folder
(or hub id), sampled greedily with sgrpo's own decoder, or an OpenAI-compatible endpoint (``url``: its base,
such as ``http://127.0.0.1:8000/v1``; a vLLM or TGI server). ``JudgeReward`` is a ``TextSimilarity``, so it
is a reward and a success test: ``success_metric`` of a reference-text task (MeetingBank, Poetry), read by
``validate`` and ``test``.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.reward import RewardResult, warn_once
from tasks.similarity import TextSimilarity

RUBRIC = (
    "You grade a response to a task against a reference answer.\n\nTask:\n{prompt}\n\nReference:\n{reference}\n\n"
    "Response:\n{response}\n\nHow well does the response fulfil the task, from 0 (not at all) to {max_score} "
    "(as well as the reference)? Reply with one line: Score: <number>"
)
_SCORE = re.compile(r"score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")  # a minus after a digit is a range's dash ("0-10"), not a sign


def after_thought(reply: str, thinking: bool = False) -> str | None:
    """The part of a judge's reply that holds its verdict: the text after the last ``</think>``; the whole reply
    when it has no think tags and the judge does not think; None when the thought never ended (cut off by the
    token cap): a thinking judge's reply without ``</think>`` (its chat template opens the thought in the
    prompt), or a reply whose ``<think>`` is not closed. ``after_thought("7? no, 8</think>Score: 8")`` ->
    ``"Score: 8"``."""
    if "</think>" in reply:
        return reply.rsplit("</think>", 1)[1]
    return None if thinking or "<think>" in reply else reply


def read_score(reply: str, max_score: float) -> float | None:
    """``reply``'s score / ``max_score``: the number after the last "Score:", else one given out of ``max_score``
    ("7/10", "7 out of 10"), else the reply's last number outside mentions of the scale ("0-10", "0 to 10"); None
    when there is none or it lies outside [0, ``max_score``]. ``read_score("Score: 7", 10)`` -> 0.7. (The reply's
    last number of "I rate it 7 out of 10", "7/10" or "3 (on a 0-10 scale)" was the scale's 10.)"""
    scale = re.escape(f"{max_score:g}")
    out_of = re.findall(rf"(?<![\d.])(\d+(?:\.\d+)?)\s*(?:/|out\s+of)\s*{scale}(?!\.?\d)", reply, re.IGNORECASE)
    unscaled = re.sub(rf"(?<![\d.])\d+(?:\.\d+)?\s*(?:-|–|to)\s*{scale}(?!\.?\d)", " ", reply)
    found = _SCORE.findall(reply) or out_of or _NUMBER.findall(unscaled)
    if not found:
        return None
    value = float(found[-1])
    return value / max_score if 0.0 <= value <= max_score else None


class JudgeError(RuntimeError):
    """A judge call that gave no score (an HTTP error, a malformed answer)."""


class JudgeReward(TextSimilarity):
    """A judge model's score of each completion in [0, 1]: ``rubric`` filled with {prompt} (the example's last user
    message, or its raw text), {reference} (``example.answer``), {response} (the completion without its think
    block) and {max_score}, answered by the judge, read by ``read_score`` from the reply after its thought
    (``after_thought``).

    A thinking judge (``thinking``: Qwen3-30B-A3B-Thinking-2507, the paper's) thinks before its verdict: it gets
    ``max_new_tokens`` 8192 by default (16 for a judge that answers at once), a reply whose thought did not end
    scores 0 (label "unfinished"), and from an OpenAI-compatible server with a reasoning parser the thought
    comes as ``reasoning_content`` (or ``reasoning``) and the verdict as ``content``.

    Exactly one of ``model`` (a local folder or hub id, loaded once on ``device``, answering greedily in at most
    ``max_new_tokens`` tokens, ``batch_size`` prompts at a time) and ``url`` (an OpenAI-compatible base URL:
    ``POST {url}/chat/completions`` with ``judge_model``, temperature 0, ``concurrency`` requests at once, each
    with a ``timeout`` in seconds; ``api_key_env`` names the environment variable holding a bearer token, if the
    server wants one). A judge that fails (no number, a number out of range, an HTTP error or timeout, a
    malformed reply) scores 0 and is counted in ``RewardResult.failures`` (labels "unparsed", "error",
    "timeout"); it never hangs (every request has its timeout, local generation its token cap).
    """

    name = "judge"

    def __init__(
        self,
        model: str | None = None,
        url: str | None = None,
        judge_model: str = "judge",
        rubric: str = RUBRIC,
        max_score: float = 10.0,
        max_new_tokens: int | None = None,
        thinking: bool = False,
        device: str = "cpu",
        batch_size: int = 16,
        concurrency: int = 8,
        api_key_env: str | None = None,
        timeout: float = 60.0,
        **kwargs,
    ) -> None:
        super().__init__(timeout=timeout, **kwargs)
        require((model is None) != (url is None), "give the judge as exactly one of model: (a folder) or url:")
        require("{response}" in rubric, "rubric must contain the placeholder {response}")
        if max_new_tokens is None:
            max_new_tokens = 8192 if thinking else 16  # room to think, or a one-line verdict
        require(max_score > 0 and max_new_tokens >= 1 and batch_size >= 1 and concurrency >= 1,
                "max_score must be > 0, and max_new_tokens, batch_size and concurrency >= 1")  # fmt: skip
        self.model, self.url, self.judge_model, self.rubric = model, url, judge_model, rubric
        self.max_score, self.max_new_tokens, self.device = max_score, max_new_tokens, device
        self.thinking = thinking
        self.batch_size, self.concurrency, self.api_key_env = batch_size, concurrency, api_key_env
        self._judge = None  # (model, tokenizer, rollout), loaded on first use

    def question(self, example: Example, completion: str) -> str:
        """The rubric filled for one completion."""
        prompt = example.prompt
        if not isinstance(prompt, str):
            prompt = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
        fields = {"prompt": prompt, "reference": example.answer, "response": self.prepare(completion),
                  "max_score": f"{self.max_score:g}"}  # fmt: skip
        text = self.rubric
        for key, value in fields.items():
            text = text.replace("{" + key + "}", str(value))
        return text

    def score(
        self, examples: Sequence[Example], completions: Sequence[str], success_at: float | None = None
    ) -> RewardResult:
        questions = [self.question(e, c) for e, c in zip(examples, completions, strict=True)]
        replies = self._ask_model(questions) if self.model is not None else self._ask_endpoint(questions)
        values, counts, failures = [], {}, 0
        for reply in replies:
            verdict = after_thought(reply, self.thinking) if isinstance(reply, str) else None
            value = None if verdict is None else read_score(verdict, self.max_score)
            label = "judged" if value is not None else reply[0] if isinstance(reply, tuple) else \
                "unfinished" if verdict is None else "unparsed"
            if value is None:
                failures += 1
                warn_once(self, f"judge gave no score ({label}): {str(reply)[:120]!r}")
            counts[label] = counts.get(label, 0) + 1
            values.append(value or 0.0)
        raw = torch.tensor(values, dtype=torch.float32)  # [N]
        total = 2.0 * raw - 1.0 if self.scale == "pm1" else raw
        success = None if success_at is None else raw >= success_at - 1e-9
        return RewardResult(total, {self.name: total}, failures, counts, success)

    def score_one(self, example: Example, completion: str) -> float:
        result = self.score([example], [completion])
        if result.failures:
            raise JudgeError(f"the judge gave no score ({next(iter(result.counts))})")
        return float(result.total[0]) if self.scale == "01" else (float(result.total[0]) + 1.0) / 2.0

    def similarity(self, prediction: str, reference: str) -> float:  # the judge reads the example: see score
        raise NotImplementedError("JudgeReward scores (example, completion) pairs: call score")

    def _ask_model(self, questions: list[str]) -> list[str]:
        if self._judge is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer  # only for a local judge

            from sgrpo.rollout.hf import HFRollout

            tokenizer = AutoTokenizer.from_pretrained(self.model)
            model = AutoModelForCausalLM.from_pretrained(self.model).to(self.device).eval()
            self._judge = (model, tokenizer, HFRollout(max_new_tokens=self.max_new_tokens))
        model, tokenizer, rollout = self._judge
        replies = []
        for start in range(0, len(questions), self.batch_size):
            batch = [Example([{"role": "user", "content": q}], "") for q in questions[start : start + self.batch_size]]
            with torch.random.fork_rng(devices=[]):  # greedy; leaves the trainer's RNG as it was
                replies += rollout.generate(model, tokenizer, batch, 1, greedy=True).completions
        return replies

    def _ask_endpoint(self, questions: list[str]) -> list[str | tuple[str, str]]:
        """Every reply by a deadline of ``timeout`` per wave of ``concurrency`` requests (plus 1 s): a server that
        trickles bytes, resetting each socket timeout, is cut off there too."""
        waves = -(-len(questions) // self.concurrency)
        deadline = time.monotonic() + self.timeout * waves + 1.0
        pool = ThreadPoolExecutor(self.concurrency)
        futures = [pool.submit(self._request, q) for q in questions]
        replies = []
        for future in futures:
            try:
                replies.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                replies.append(("timeout", f"no reply by the {self.timeout * waves + 1.0:g} s deadline"))
        pool.shutdown(wait=False, cancel_futures=True)  # a thread still reading ends at its socket timeout
        return replies

    def _request(self, question: str) -> str | tuple[str, str]:
        """The judge's reply, or ("timeout" | "error", why)."""
        body = {"model": self.judge_model, "messages": [{"role": "user", "content": question}], "temperature": 0.0,
                "max_tokens": self.max_new_tokens}  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if self.api_key_env and os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.api_key_env]}"
        request = urllib.request.Request(
            self.url.rstrip("/") + "/chat/completions", json.dumps(body).encode(), headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                reply = json.loads(response.read())
            return reply_text(reply["choices"][0]["message"])
        except TimeoutError as err:
            return ("timeout", str(err))
        except urllib.error.URLError as err:
            timed_out = isinstance(err.reason, TimeoutError)
            return ("timeout" if timed_out else "error", str(err))
        except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
            return ("error", f"{type(err).__name__}: {err}")


def reply_text(message: dict) -> str:
    """An OpenAI-compatible chat message as one reply: a thought a reasoning parser split off (``reasoning_content``,
    or ``reasoning`` in newer vLLM) comes back inside ``<think>...</think>`` before the content; a thought without
    content (cut off by ``max_tokens``) stays open, so ``after_thought`` finds no verdict."""
    content = message.get("content") or ""
    thought = message.get("reasoning_content") or message.get("reasoning")
    if not thought:
        return str(content)
    return f"<think>{thought}</think>{content}" if content else f"<think>{thought}"
