"""Sample completions in the logs: a few groups every N steps, as ``completions.jsonl`` and in the logger.

Each row: the step, the group, the prompt (decoded from its tokens), the completion, its reward and every
reward component, whether it succeeded, and its advantage; a multi-turn episode's row adds ``episode``: its
messages, the environment's per-turn rewards and its counts (``episode_record``). The run folder's
``completions.jsonl`` gets one JSON object per row; TensorBoard gets a markdown table as text (``completions``),
W&B a table. A fit resumed from a checkpoint first drops the file's rows of the steps it will log again
(``drop_rows_from``), so each step's rows appear once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import Tensor

from sgrpo.eval.metrics_file import append_lines
from sgrpo.types import RolloutBatch


def completion_rows(
    step: int,
    rollout: RolloutBatch,
    prompts: list[str],
    rewards: Tensor,
    success: Tensor,
    parts: dict[str, Tensor],
    advantages: Tensor,
    groups: int,
) -> list[dict[str, Any]]:
    """Rows for the first ``groups`` groups; ``rewards``/``success``/``parts``/``advantages`` ``[B, G]``."""
    rows = []
    size = rollout.group_size
    for b in range(min(groups, rollout.num_groups)):
        for g in range(size):
            row = {"step": step, "group": b, "prompt": prompts[b], "completion": rollout.completions[b * size + g]}
            row |= {"reward": float(rewards[b, g]), "success": bool(success[b, g])}
            row |= {"advantage": float(advantages[b, g])}
            row |= {f"reward/{name}": float(values[b, g]) for name, values in parts.items()}
            if rollout.episodes is not None:
                row["episode"] = episode_record(rollout.episodes[b * size + g])
            rows.append(row)
    return rows


def episode_record(episode) -> dict[str, Any]:
    """A multi-turn episode as JSON: its messages (opening, turns, observations), the environment's per-turn
    rewards (null where a turn had none) and its counts."""
    counts = ("turns", "tool_calls", "tool_failures", "generated_tokens", "observation_tokens", "forks")
    return {"messages": episode.messages, "turn_rewards": episode.rewards} | {k: getattr(episode, k) for k in counts}


def write_rows(rows: list[dict[str, Any]], run_dir: Path, loggers: list, step: int) -> None:
    """Append ``rows`` to ``run_dir/completions.jsonl`` and hand them to TensorBoard / W&B loggers."""
    if not rows:
        return
    append_lines(run_dir / "completions.jsonl", [json.dumps(row, ensure_ascii=False) for row in rows])
    columns = list(rows[0])
    for logger in loggers:
        kind = type(logger).__name__
        if kind == "TensorBoardLogger":
            logger.experiment.add_text("completions", markdown_table(columns, rows), global_step=step)
        elif kind == "WandbLogger":
            data = [[json.dumps(r[c]) if isinstance(r[c], dict) else r[c] for c in columns] for r in rows]
            logger.log_table(key="completions", columns=columns, data=data, step=step)


def drop_rows_from(path: Path, step: int) -> int:
    """Remove the rows of ``step`` and later from the completions file ``path`` (a resume from an older checkpoint
    logs those steps again); the file is replaced whole (written beside it, then renamed). Returns how many rows
    went; a line that is no JSON row (cut short by a kill) goes too."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
            keep = isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step
        except (UnicodeDecodeError, json.JSONDecodeError):
            keep = False
        if keep:
            kept.append(line + b"\n")
        else:
            dropped += 1
    if dropped:
        fresh = path.with_name(path.name + ".tmp")
        fresh.write_bytes(b"".join(kept))
        os.replace(fresh, path)
    return dropped


def markdown_table(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """Rows as a markdown table (cells escaped: pipes, newlines)."""
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        text = json.dumps(value) if isinstance(value, dict) else text
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
