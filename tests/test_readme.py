"""The README's Python snippets run as written, and print what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(compile(BLOCKS[index], f"README.md[python {index}]", "exec"), namespace)
    if "HalfRLOO" in namespace:  # "exact c_G(p) = 4.0, for free"
        assert namespace["HalfRLOO"]().population_weight(0.3, group_size=8).item() == pytest.approx(4.0)
    if "task" in namespace:  # "tensor([1.])"
        assert "tensor([1.])" in capsys.readouterr().out
    if "SoftmaxGRPO" in namespace and "p" in namespace:
        got = namespace["SoftmaxGRPO"](temperature=1.0).population_weight(namespace["p"], 8)
        assert torch.allclose(got, torch.tensor([9.4693, 7.9953, 6.6067, 5.5795, 4.9433], dtype=got.dtype), atol=1e-4)
