"""`--help` documents every key of the model block and of its main components (Args sections of their
docstrings, read by LightningCLI)."""

from __future__ import annotations

import inspect

import docstring_parser
import pytest

from sgrpo.fit import parse
from sgrpo.lora import LoRA
from sgrpo.loss import ClippedSurrogate
from sgrpo.policy import GRPOPolicy
from sgrpo.rollout import HFRollout
from sgrpo.vllm_rollout import VLLMRollout


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
    assert "--model.group_size GROUP_SIZE Completions per prompt" in out
    assert "--model.peft PEFT LoRA adapters" in out
