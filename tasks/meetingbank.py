"""MeetingBank (``huuuyeah/meetingbank``: id, uid, summary, transcript): summarise a council item."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sgrpo.checks import require
from sgrpo.types import Example
from tasks.base import check_template, fill
from tasks.reward import Reward
from tasks.similarity import RougeL, TextSimilarity
from tasks.text import ReferenceTextTask

TEMPLATE = (
    "Summarize the following city council meeting transcript in one or two sentences.\n\n"
    "Transcript:\n{transcript}\n\nSummary:"
)


class MeetingBank(ReferenceTextTask):
    """Transcript -> one-sentence summary, rewarded by ROUGE-L F1 (``RougeL()``, in [0, 1]).

    The hub set has train / validation / test splits (5,169 / 861 / 862 rows, the first two inferred).
    Long transcripts are cut to ``max_transcript_tokens``: counted with ``tokenizer`` (a Hugging Face
    name or local folder) when given, else approximated as ``max_transcript_tokens * words_per_token``
    words. Success (the "accuracy" of a summary): ROUGE-L >= ``success_threshold`` (0.3, an arbitrary
    choice to state with any result). The paper's prompt and metric are unknown; ``TEMPLATE`` is ours.
    ``settings``: those of ``ReferenceTextTask`` (``seed``, ``chat``, ...).
    """

    required_columns = ("summary", "transcript")
    nonblank_columns = ("transcript", "summary")
    optional_columns = ("id", "uid")

    def __init__(
        self,
        path: str = "huuuyeah/meetingbank",
        template: str = TEMPLATE,
        max_transcript_tokens: int | None = 3072,
        tokenizer: str | None = None,
        words_per_token: float = 0.75,
        reward: Reward | None = None,
        validation_size: int | float = 0,
        test_size: int | float = 0,
        success_metric: TextSimilarity | None = None,
        success_threshold: float = 0.3,
        **settings,
    ) -> None:
        check_template(template, ["transcript"])
        limit = max_transcript_tokens
        require(limit is None or limit >= 1, f"max_transcript_tokens must be >= 1 or None (no cut), got {limit}")
        require(words_per_token > 0, f"words_per_token must be > 0, got {words_per_token}")
        self.template, self.max_transcript_tokens = template, max_transcript_tokens
        self.tokenizer, self.words_per_token = tokenizer, words_per_token
        self._tokenizer = None
        super().__init__(
            path=path,
            reward=reward or RougeL(),
            validation_size=validation_size,
            test_size=test_size,
            success_metric=success_metric or RougeL(),
            success_threshold=success_threshold,
            **settings,
        )

    def load(self, split: str) -> Sequence[Example]:
        if self.tokenizer is not None and self._tokenizer is None:
            from transformers import AutoTokenizer  # only when asked: slow to import

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        return super().load(split)

    def truncate(self, transcript: str) -> tuple[str, bool]:
        """The transcript cut to the token budget, and whether it was cut."""
        limit = self.max_transcript_tokens
        if limit is None:
            return transcript, False
        if self._tokenizer is not None:
            ids = self._tokenizer(transcript, add_special_tokens=False)["input_ids"]
            return (transcript, False) if len(ids) <= limit else (self._tokenizer.decode(ids[:limit]), True)
        words = transcript.split()
        keep = max(1, int(limit * self.words_per_token))
        return (transcript, False) if len(words) <= keep else (" ".join(words[:keep]), True)

    def make_example(self, row: Mapping) -> Example:
        transcript, cut = self.truncate(str(row["transcript"]).strip())
        metadata = {"uid": row.get("uid", ""), "id": row.get("id"), "truncated": cut}
        return Example(
            self.as_prompt(fill(self.template, transcript=transcript)),
            str(row["summary"]).strip(),
            metadata=metadata,
        )
