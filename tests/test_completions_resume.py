"""``completions.jsonl`` after a kill and a resume: each step's rows once (a resume from an older checkpoint logs the
steps after it again, and the file kept both copies)."""

from __future__ import annotations

import json

from sgrpo.eval.completions import drop_rows_from
from sgrpo.fit import main
from tests.test_checkpoint_files import fit_args

LOGGED = ("--model.log_completions_every=1", "--model.log_completions_groups=1")


def test_drop_rows_from_keeps_earlier_steps_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "completions.jsonl"
    rows = [{"step": s, "group": 0, "completion": c} for s in (0, 1, 2) for c in ("a", "b")]
    path.write_bytes(("\n".join(json.dumps(r) for r in rows) + '\n{"step": 3, "gro').encode())
    assert drop_rows_from(path, 2) == 3  # step 2's two rows and the cut line
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
    assert drop_rows_from(path, 2) == 0 and drop_rows_from(tmp_path / "none.jsonl", 0) == 0


def test_a_resumed_fit_logs_each_step_s_completions_once(tmp_path):
    main(fit_args(tmp_path, "--trainer.max_steps=2", *LOGGED))
    path = tmp_path / "completions.jsonl"
    clean = path.read_text()
    killed = [{"step": s, "group": 0, "prompt": "stale", "completion": "x"} for s in (2, 3)]
    path.write_text(clean + "".join(json.dumps(r) + "\n" for r in killed) + '{"step": 3, "pro')  # a kill's leftovers
    main(fit_args(tmp_path, "--trainer.max_steps=4", "--ckpt_path=last", *LOGGED))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path.read_text().startswith(clean)  # the steps before the checkpoint untouched
    assert [r["step"] for r in rows] == [s for s in range(4) for _ in range(4)]  # 1 group of G = 4 rows per step
    assert all(r["prompt"] != "stale" for r in rows)
