"""Tasks: datasets of ``Example`` s with a reward and a success test, one file per task."""

from tasks.arithmetic import CountdownReward, grade_countdown
from tasks.base import SPLITS, Task
from tasks.calculator import CalculatorTask
from tasks.countdown import Countdown, CountdownGold
from tasks.deepmath import DeepMath
from tasks.environment import Environment, Observation, ToolEnvironment
from tasks.functions import FunctionReward
from tasks.gsm8k import GSM8K
from tasks.holdout import hash_holdout, paper_holdout
from tasks.judge import JudgeReward
from tasks.lazy_table import LazySplitTable
from tasks.mathgrade import (
    MathVerifyReward,
    NumericMatch,
    PaperMathVerify,
    final_text_verifier,
    grade_math,
    grade_paper_math,
)
from tasks.meetingbank import MeetingBank
from tasks.openthoughts import OpenThoughts
from tasks.poetry import PoetryClassification, PoetryWriting
from tasks.polaris import Polaris
from tasks.reward import Reward, RewardResult, SampleReward, WeightedSum
from tasks.similarity import (
    Bleu,
    ChrF,
    EditSimilarity,
    ExactMatch,
    RougeL,
    TextSimilarity,
    WordSimilarity,
    final_text,
)
from tasks.synthetic import SyntheticTask
from tasks.text import ReferenceText, ReferenceTextTask
from tasks.think_format import ThinkFormat, think_format

__all__ = [
    "LazySplitTable",
    "SPLITS",
    "Bleu",
    "CalculatorTask",
    "ChrF",
    "Countdown",
    "CountdownGold",
    "CountdownReward",
    "DeepMath",
    "EditSimilarity",
    "Environment",
    "FunctionReward",
    "ExactMatch",
    "GSM8K",
    "JudgeReward",
    "MathVerifyReward",
    "MeetingBank",
    "NumericMatch",
    "Observation",
    "OpenThoughts",
    "PaperMathVerify",
    "PoetryClassification",
    "PoetryWriting",
    "Polaris",
    "ReferenceText",
    "ReferenceTextTask",
    "Reward",
    "RewardResult",
    "SampleReward",
    "RougeL",
    "SyntheticTask",
    "Task",
    "TextSimilarity",
    "ThinkFormat",
    "ToolEnvironment",
    "WeightedSum",
    "WordSimilarity",
    "final_text",
    "final_text_verifier",
    "grade_countdown",
    "grade_math",
    "grade_paper_math",
    "hash_holdout",
    "paper_holdout",
    "think_format",
]
