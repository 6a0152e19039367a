"""What a run reports: validation and test (``PolicyEvaluation``), the torchmetrics metrics synced over processes,
the pass@k maths, the run's ``metrics.jsonl``, the report and curves, and the completions log."""

from sgrpo.eval.evaluation import PolicyEvaluation, evaluation_table
from sgrpo.eval.metrics_file import MetricsFile
from sgrpo.eval.passk import pass_at_k
from sgrpo.eval.report import write_report

__all__ = ["MetricsFile", "PolicyEvaluation", "evaluation_table", "pass_at_k", "write_report"]
