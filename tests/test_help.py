"""`--help` documents every key of the model block and of its main components (Args sections of their
docstrings, read by LightningCLI)."""

from __future__ import annotations

import inspect

import docstring_parser
import pytest

from sgrpo.fit import parse
from sgrpo.model.lora import LoRA
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from sgrpo.rollout.vllm_engine import VLLMRollout
from sgrpo.train.loss import ClippedSurrogate


@pytest.mark.parametrize("cls", [GRPOPolicy, ClippedSurrogate, HFRollout, VLLMRollout, LoRA], ids=lambda c: c.__name__)
def test_every_argument_is_documented(cls):
    documented = {p.arg_name: p.description for d in (cls.__doc__, cls.__init__.__doc__) if d
                  for p in docstring_parser.parse(d).params}  # fmt: skip
    arguments = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    assert [name for name in arguments if not documented.get(name)] == []


def test_help_prints_the_descriptions(capsys):
    with pytest.raises(SystemExit):
        parse(["fit", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m sgrpo.fit ")  # the command users type (it was 'fit.py')
    assert "--model.group_size GROUP_SIZE Completions per prompt" in out
    assert "--model.peft PEFT LoRA adapters" in out


def test_a_fit_prints_its_parameters_in_one_line_and_no_lightning_tip(caplog):
    import logging
    from types import SimpleNamespace

    import torch

    from sgrpo.fit import quiet_dependency_warnings
    from sgrpo.run.progress import ParameterCount

    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))  # 220 + 105 parameters
    model[0].requires_grad_(False)
    quiet_dependency_warnings()
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=rank_zero.name):
        ParameterCount().on_fit_start(None, SimpleNamespace(model=model))
        rank_zero.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
    assert [r.getMessage() for r in caplog.records] == ["Sequential: 325 parameters, 105 trainable"]


def test_a_refusal_is_one_write_so_two_processes_lines_never_run_together(monkeypatch):
    import sys

    from sgrpo.checks import exit_with_error

    writes = []
    monkeypatch.setattr(sys, "stderr", type("Stderr", (), {"write": lambda self, s: writes.append(s),
                                                             "flush": lambda self: None})())  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        exit_with_error("invalid configuration: model.prompts_per_step (3) must divide evenly", 2)
    assert exit_.value.code == 2  # print() made two writes: the text, then "\n" (lines of 2 processes interleaved)
    assert writes == ["error: invalid configuration: model.prompts_per_step (3) must divide evenly\n"]
