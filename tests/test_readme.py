"""The README's Python snippets run as written, and print what their comments say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_snippets():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_snippet_runs(index, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(compile(BLOCKS[index], f"README.md[python {index}]", "exec"), namespace)
    if "HalfRLOO" in namespace:  # "exact c_G(p) = 4.0, for free"
        assert namespace["HalfRLOO"]().population_weight(0.3, group_size=8).item() == pytest.approx(4.0)
    if "brevity" in namespace:  # "tensor([1.2000, 0.1000]) tensor([1.0000, 0.5000])"
        assert "tensor([1.2000, 0.1000]) tensor([1.0000, 0.5000])" in capsys.readouterr().out
    if "task" in namespace:  # "tensor([1.])"
        assert "tensor([1.])" in capsys.readouterr().out
    if "SoftmaxGRPO" in namespace and "p" in namespace:
        got = namespace["SoftmaxGRPO"](temperature=1.0).population_weight(namespace["p"], 8)
        want = torch.tensor([9.4693, 7.9953, 6.6067, 5.5795, 4.9433], dtype=got.dtype)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_readme_fit_commands_never_share_a_run_folder():
    """Each fresh run the README shows trains into a folder of its own (a resume reuses its run's folder)."""
    # a command ends at its closing backtick, a comment, or a line that is not its indented continuation
    commands = {" ".join(c.split()) for c in re.findall(r"python -m sgrpo\.fit (--config.*?)(?:`|#|\n(?! ))", README,
                                                         flags=re.S)}  # fmt: skip
    folders = {}
    for command in commands:
        if "--ckpt_path" in command or "--print_config" in command:
            continue
        root = re.search(r"--trainer\.default_root_dir[= ](\S+)", command)
        configs = [yaml.safe_load((REPO / path).read_text()) for path in re.findall(r"--config (\S+)", command)]
        named = [c["trainer"]["default_root_dir"] for c in configs if "default_root_dir" in c.get("trainer", {})]
        folders[command] = root.group(1) if root else named[-1]  # the last config that names one wins

    assert len(folders) >= 4 and len(set(folders.values())) == len(folders), folders
