"""benchmarks/throughput.py's ``--case profile`` end to end at a tiny size: sgrpo's step phases are timed (the
update's forward, backward and optimiser step among them) and torch's top operators printed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from benchmarks import _workload_profile as profile
from benchmarks._alternating import build_model
from benchmarks._workload import Workload


@pytest.mark.bench
def test_profile_case_times_every_phase(tmp_path: Path, capsys):
    build_model(tmp_path, None, hidden=32, layers=1, heads=2, intermediate=64, positions=64)
    work = Workload(model_dir=str(tmp_path), prompts=4, group_size=4, new_tokens=4, steps=3, threads=1)
    profile.profile_sgrpo(work, warmup=1, top_ops=5)
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (?:&nbsp;)*(.+?) \| (-?[\d.]+) \|", out, re.M))
    assert set(rows) == {label for label, _ in profile.PHASES}
    for label in ("update", "model forward (final_hidden_states)", "manual_backward", "training_step"):
        assert float(rows[label]) > 0, label
    assert float(rows["update"]) >= float(rows["manual_backward"])
    assert "torch.profiler" in out and "aten::" in out
    assert "completion_logprobs" in sys.modules["sgrpo.model.logprobs"].__dict__  # the patches were undone
    assert sys.modules["sgrpo.model.logprobs"].final_hidden_states.__module__ == "sgrpo.model.logprobs"


def test_the_workload_reaches_sgrpo_with_packing_and_prompt_sharing_as_set(tmp_path: Path):
    """The ablation case's variants undo packing, prompt sharing and the lean MLP through the Workload: GRPOPolicy
    gets them."""
    from benchmarks._workload import sgrpo_policy
    from benchmarks.throughput import ABLATIONS

    for _, changes in ABLATIONS:
        work = Workload(model_dir=str(tmp_path), **changes)
        policy = sgrpo_policy(work)  # no model loads here (configure_model does)
        assert (policy.packing, policy.share_prompts) == (work.packing, work.share_prompts)
        assert (policy.lean_mlp, policy.lean_norm) == (work.lean_mlp, work.lean_norm)
        assert policy.micro_batch_tokens == work.micro_batch_tokens
    assert {"packing": False} in [changes for _, changes in ABLATIONS]
    assert {"lean_mlp": False} in [changes for _, changes in ABLATIONS]
    assert {"lean_norm": False} in [changes for _, changes in ABLATIONS]
