"""Tasks: datasets of ``Example`` s with a reward and a success test, one file per task.

Every public name is imported from its module on first use (PEP 562's module ``__getattr__``), so a run pays only
for the tasks it uses: ``import tasks`` or ``tasks.SyntheticTask`` loads neither sympy and math-verify (the math
grader, ``tasks.mathgrade``) nor sacrebleu (chrF and BLEU). ``from tasks import X`` and ``tasks.X`` work as before.
"""

from __future__ import annotations

import importlib

#: each public name's module under ``tasks``
_MODULES = {
    "arithmetic": ("CountdownReward", "grade_countdown"),
    "base": ("SPLITS", "Task"),
    "calculator": ("CalculatorTask",),
    "countdown": ("Countdown", "CountdownGold"),
    "deepmath": ("DeepMath",),
    "environment": ("Environment", "Observation", "ToolEnvironment"),
    "functions": ("FunctionReward",),
    "gsm8k": ("GSM8K",),
    "holdout": ("hash_holdout", "paper_holdout"),
    "judge": ("JudgeReward",),
    "lazy_table": ("LazySplitTable",),
    "mathgrade": (
        "MathVerifyReward", "NumericMatch", "PaperMathVerify", "final_text_verifier", "grade_math", "grade_paper_math",
    ),
    "meetingbank": ("MeetingBank",),
    "openthoughts": ("OpenThoughts",),
    "poetry": ("PoetryClassification", "PoetryWriting"),
    "polaris": ("Polaris",),
    "reward": ("Reward", "RewardResult", "SampleReward", "WeightedSum"),
    "similarity": (
        "Bleu", "ChrF", "EditSimilarity", "ExactMatch", "RougeL", "TextSimilarity", "WordSimilarity", "final_text",
    ),
    "synthetic": ("SyntheticTask",),
    "text": ("ReferenceText", "ReferenceTextTask"),
    "think_format": ("ThinkFormat", "think_format"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """``tasks.name``: imported from its module on first use, then cached in this module's namespace."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tasks.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

