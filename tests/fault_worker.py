"""Run by test_faults.py and test_faults_processes.py in a fresh interpreter: ``sgrpo.fit`` with a fault injected
at one point.

fault_worker.py stall STEP MARKER FIT_ARGS...   the checkpoint write at global step STEP (stepSTEP.ckpt, of
                                                which last.ckpt becomes a link) writes half of its bytes,
                                                creates MARKER and hangs there (the test kills it)
fault_worker.py raise RANK STEP FIT_ARGS...     process RANK (of a multi-process fit: Lightning's launcher runs
                                                this same command for the others) raises inside the gradient
                                                accumulation of training step STEP (1-based), as a CUDA
                                                out-of-memory would (ROOT/raised.RANK marks the moment)
fault_worker.py raise_hang RANK STEP FIT_ARGS... the same, while the other processes wait there on the process
                                                group's store for a key no process posts (as when building NCCL's or
                                                vLLM's groups for a peer that died): no notice reaches them through
                                                a collective or the launcher
fault_worker.py raise_validate RANK 0 ARGS...    ``sgrpo.fit validate`` (ARGS start with "validate") where process
                                                RANK raises in its first validation batch while the others wait on
                                                the store there
fault_worker.py sigterm_validate RANK 0 ARGS...  process RANK sends itself SIGTERM in its first validation batch
                                                (ROOT/raised.RANK marks it) while the others validate on
fault_worker.py report_fails RANK 0 FIT_ARGS...  process RANK's report raises after the fit (the others are done)
fault_worker.py sigterm_export RANK 0 FIT_ARGS... process RANK sends itself SIGTERM in its part of the export
fault_worker.py sigterm RANK STEP FIT_ARGS...    process RANK sends itself SIGTERM there instead
fault_worker.py slow_rollout 0 STEP FIT_ARGS...  every process's rollout of training step STEP (1-based) sleeps
                                                0.3 s before each decode step (ROOT/rollout.RANK marks its first),
                                                the first until ROOT/signalled exists (at most 60 s): the test's
                                                SIGTERM lands in the rollout
fault_worker.py producer_dies RANK STEP FIT_ARGS... (with async rollouts) process RANK's rollout producer kills
                                                itself before it samples step STEP (0-based); ROOT/raised.RANK marks
                                                the trainer's ProducerError
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

INJECTED = "injected fault: out of memory in the gradient accumulation"


def stall_at(step: int, marker: Path) -> None:
    save = torch.save

    def stalling_save(obj, f, *args, **kwargs):
        into_file = bool(getattr(f, "name", ""))  # a file (not a buffer) that becomes a checkpoint
        if into_file and isinstance(obj, dict) and obj.get("global_step") == step:
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: buffer.tell() // 2])
            f.flush()
            marker.touch()
            time.sleep(600)
        return save(obj, f, *args, **kwargs)

    torch.save = stalling_save


def wait_on_the_store() -> None:
    """Wait on the process group's store for a key no process posts (for the group's timeout: 30 minutes)."""
    from torch.distributed.distributed_c10d import _get_default_store

    _get_default_store().get("sgrpo/test/never-posted")


def this_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def raise_in_validation(rank: int, sigterm: bool = False) -> None:
    from sgrpo.policy import GRPOPolicy

    validation_step, sent = GRPOPolicy.validation_step, []

    def failing(self, *args, **kwargs):
        if this_rank() == rank and sigterm and not sent:
            sent.append(os.getpid())
            Path(self.trainer.default_root_dir, f"raised.{rank}").touch()
            os.kill(os.getpid(), signal.SIGTERM)
        elif this_rank() == rank and not sigterm:
            Path(self.trainer.default_root_dir, f"raised.{rank}").touch()
            raise RuntimeError(f"{INJECTED} (process {rank}, validation)")
        elif not sigterm:
            wait_on_the_store()
        return validation_step(self, *args, **kwargs)

    GRPOPolicy.validation_step = failing


def fail_at_the_end(rank: int, where: str) -> None:
    """Process ``rank`` fails after the fit alone: its report raises (``report``), or it gets SIGTERM in its part of
    the end-of-fit export (``export``); ROOT/raised.RANK marks the moment."""
    if this_rank() != rank:
        return
    import sgrpo.eval.report
    import sgrpo.export

    def mark(trainer_root) -> None:
        Path(trainer_root, f"raised.{rank}").touch()

    if where == "report":
        def failing_report(policy, trainer):
            mark(trainer.default_root_dir)
            raise RuntimeError(f"{INJECTED} (process {rank}, report)")

        sgrpo.eval.report.write_report = failing_report
        return
    save = sgrpo.export.save_policy

    def cut(model, tokenizer, path, *args, **kwargs):
        mark(path.parent)
        os.kill(os.getpid(), signal.SIGTERM)
        return save(model, tokenizer, path, *args, **kwargs)

    sgrpo.export.save_policy = cut


def raise_at(rank: int, step: int, others_hang: bool = False, sigterm: bool = False) -> None:
    from sgrpo.train.update import PolicyUpdate

    accumulate, sent = PolicyUpdate.accumulate_gradients, []
    me = this_rank()

    def failing(self, *args, **kwargs):
        if me == rank and self.rollout_step == step - 1 and sigterm and not sent:
            sent.append(os.getpid())
            os.kill(os.getpid(), signal.SIGTERM)
        elif me == rank and self.rollout_step == step - 1 and not sigterm:
            Path(self.trainer.default_root_dir, f"raised.{rank}").touch()
            raise RuntimeError(f"{INJECTED} (process {rank}, step {step})")
        if others_hang and self.rollout_step == step - 1:
            wait_on_the_store()
        return accumulate(self, *args, **kwargs)

    PolicyUpdate.accumulate_gradients = failing


def slow_rollout(step: int) -> None:
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout.decode import DecodeSteps

    sample, decode_step, slowed, root = GRPOPolicy.sample, DecodeSteps.__call__, [], []

    def marked(self, examples, sampling_round: int = 0):
        if self.rollout_step == step - 1:
            slowed.append(True)
            root.append(self.trainer.default_root_dir)
        try:
            return sample(self, examples, sampling_round)
        finally:
            slowed.clear()

    def slow(self, *args, **kwargs):
        if slowed:
            if len(slowed) == 1:  # marked at the first decode step, inside the rollout (at sample's start, a SIGTERM
                Path(root[-1], f"rollout.{this_rank()}").touch()  # could land in the prompts' prefill, before it)
            time.sleep(0.3)
            waited = time.monotonic()
            while len(slowed) == 1 and time.monotonic() < waited + 60 and not Path(root[-1], "signalled").exists():
                time.sleep(0.05)
            slowed.append(True)
        return decode_step(self, *args, **kwargs)

    GRPOPolicy.sample, DecodeSteps.__call__ = marked, slow


def producer_dies(rank: int, step: int) -> None:
    from sgrpo.rollout.producer import FAULT_ENV, RolloutProducer

    if this_rank() != rank:
        return
    os.environ[FAULT_ENV] = f"die@{step}"
    take = RolloutProducer.take

    def marked(self, *args, **kwargs):
        try:
            return take(self, *args, **kwargs)
        except Exception:
            Path(os.environ["SGRPO_TEST_ROOT"], f"raised.{rank}").touch()
            raise

    RolloutProducer.take = marked


if __name__ == "__main__":
    mode, first, second, *fit_args = sys.argv[1:]
    if mode == "producer_dies":
        producer_dies(int(first), int(second))
    elif mode == "stall":
        stall_at(int(first), Path(second))
    elif mode == "slow_rollout":
        slow_rollout(int(second))
    elif mode in ("report_fails", "sigterm_export"):
        fail_at_the_end(int(first), "report" if mode == "report_fails" else "export")
    elif mode in ("raise_validate", "sigterm_validate"):
        raise_in_validation(int(first), sigterm=mode == "sigterm_validate")
    else:
        raise_at(int(first), int(second), others_hang=mode == "raise_hang", sigterm=mode == "sigterm")
    from sgrpo.distributed import released_after
    from sgrpo.fit import main

    released_after(lambda: main(fit_args))  # as python -m sgrpo.fit ends
