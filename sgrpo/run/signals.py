"""What a signal does to a run: SIGTERM and Ctrl-C stop it at a step's end (one process's error, which ends every
process, is ``sgrpo.run.faults``).

During training, SIGTERM and the first Ctrl-C are recorded, not raised (``StopRequests``):
the step under way runs to its end, ``RunCheckpoint`` saves ``last.ckpt`` there (the only state a resume
continues exactly) and ``Stopped`` ends the fit with 143 or 130. A signal during a validation stops at
the end of that validation's current batch; the checkpoint then holds the step before it and the
validation runs again on resume. The processes agree on the stop (one all-reduce per step and per
validation batch), so they all save at the same step: the save is a collective under FSDP2. A single
process does not wait where the state is still the last step's end (the rollout after it, a validation):
it saves and stops at once (``StoppedNow``), as a step can outlast the scheduler's grace period. Several
processes do so during a rollout, once they agree (``sgrpo.rollout_stop.RolloutStop``: the signal is posted in
the store, ``STOP_KEY``, by the fault watch, ``sgrpo.run.faults.AbortWatch``, which reads the others'); a SIGTERM
while a stop saves is ignored. A second Ctrl-C stops at once (``KeyboardInterrupt``), saving only where the state is
a step's end; one after the stop began exits 130 with one line. Under Lightning's own launcher the first process
forwards SIGTERM to the others, as Lightning does. Outside a fit's training loop (``validate``, ``test``,
``validate_before``, a sanity check) Lightning's handler stays, without its collective
(``sigterm_without_collective``): the process stops at its evaluation's next batch, and with several processes
that ends them all as an error of one process does.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

import torch


class Stopped(SystemExit):
    """A fit stopped by SIGTERM (exit 143) or Ctrl-C (130) at a step's end, ``last.ckpt`` saved there."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class StoppedNow(Stopped):
    """A fit stopped by a signal that arrived while the state was still the last step's end (during the rollout
    that follows it, or a validation): ``last.ckpt`` is saved at once, without running the step to its end."""


class StopRequests:
    """SIGTERM and the first Ctrl-C recorded while installed (from the main thread), to stop at a step's end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._forward: Callable[[int], None] | None = None
        self._now: Callable[[], bool] | None = None
        self._agree: Callable[[int], bool] | None = None

    def install(self, forward: Callable[[int], None] | None = None, now: Callable[[], bool] | None = None,
                agree: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        """Take over SIGTERM and SIGINT; ``forward(signum)`` passes a SIGTERM on (to the processes this one started);
        where ``now()`` holds when a signal arrives (the state is a step's end and may be saved from here: one
        process), the fit stops at once (``StoppedNow``) instead of at the end of the step under way; where
        ``agree(signum)`` takes it (several processes, in a rollout: ``sgrpo.rollout_stop.RolloutStop``), every
        process stops at that rollout's end or one of its checks."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.signum, self._forward, self._now, self._agree = None, forward, now, agree
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self, stopping: bool = False) -> None:
        """Put the previous handlers back; after a Ctrl-C, one that ends the process at the next Ctrl-C with exit
        130 and one line (``SystemExit``, no traceback): the stop's save and teardown run without our handler,
        and a KeyboardInterrupt raised in them ended the process by a traceback, or by SIGINT itself. While a stop
        saves (``stopping``, or a signal received), a SIGTERM is noted and ignored: the processes of a job get it
        at different times (SLURM signals every task), and one that arrived after another's stop had reached
        this process killed it in the middle of the save. (``command_ended`` puts SIGTERM's handler back.)"""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._previous and (stopping or self.signum is not None):
            signal.signal(signal.SIGTERM, _already_stopping)
        if self._previous and self.signum == signal.SIGINT:
            signal.signal(signal.SIGINT, _leave_now)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if self.signum is not None:
            return
        self.signum = signum
        name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        if signum == signal.SIGTERM and self._forward is not None:
            self._forward(signum)
        if self._now is not None and self._now():  # a rollout or validation: nothing a resume needs is under way
            print(f"\n{name}: saving last.ckpt (the last step's end) and stopping now", file=sys.stderr, flush=True)
            raise StoppedNow(signum)
        if self._agree is not None and self._agree(signum):  # several processes, in a rollout: they agree first
            print(f"\n{name}: every process stops at its rollout's next check, saving last.ckpt (the last step's end)",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""
        print(f"\n{name}: stopping at the end of this step, after saving last.ckpt{again}", file=sys.stderr)

    def adopt_noted(self, trainer) -> None:
        """A SIGTERM that Lightning's handler noted since the trainer call began (``sigterm_without_collective``: in
        a sanity check) taken as this stop's, so the first step's end stops the fit on every process (Lightning's
        training loop would raise at once, on process 0 only)."""
        if trainer.received_sigterm:
            trainer._signal_connector.received_sigterm = False
            self.signum = signal.SIGTERM
            print("\nSIGTERM: stopping at the end of this step, after saving last.ckpt", file=sys.stderr, flush=True)

    def agreed(self, device: torch.device) -> int | None:
        """The signal any process received (a collective with more than one process), else None."""
        signum = self.signum or 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            value = torch.tensor(float(signum), device=device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            signum = int(value.item())
        return signum or None


def _already_stopping(signum: int, frame) -> None:
    """A SIGTERM while the stop saves: it goes on (the scheduler's SIGKILL follows if it lasts too long)."""
    print("\nSIGTERM: already stopping (saving last.ckpt)", file=sys.stderr, flush=True)


def _leave_now(signum: int, frame) -> NoReturn:
    """A Ctrl-C once the stop is under way: exit 130 now, with one line and no traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third one, while this one unwinds
    print("\nCtrl-C again: stopping now", file=sys.stderr, flush=True)
    raise SystemExit(128 + signal.SIGINT)


def sigterm_without_collective(trainer) -> None:
    """Lightning's SIGTERM handler, which it installs at each trainer call (``StopRequests`` replaces it in a fit's
    training loop), without the broadcast it runs inside the handler under several processes: the process that
    got the signal alone waited there in a collective no other process joined, and every process hung until the
    process group's timeout (a SIGTERM during ``validate``, ``validate_before``, ``validate_last`` or a sanity
    check). Here the handler records the signal and forwards it to the processes Lightning's launcher started, as
    Lightning's does: Lightning's evaluation loop raises ``SIGTERMException`` at that process's next batch, an error
    of one process (``fail_fast``: exit 143, every other process ended through the store); one noted before a fit's
    training loop becomes its stop at the first step's end (``RunCheckpoint.on_train_start``)."""
    connector, forward = trainer._signal_connector, forward_signal(trainer)

    def noted(signum: int, frame) -> None:
        if not connector.received_sigterm:
            forward(signum)
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = noted  # read when the handlers are registered, at each trainer call


def forward_signal(trainer) -> Callable[[int], None]:
    """Pass a signal on to the processes Lightning's launcher started from this one (a no-op elsewhere)."""

    def forward(signum: int) -> None:
        for process in getattr(trainer.strategy.launcher, "procs", None) or []:
            if process.poll() is None:
                process.send_signal(signum)

    return forward


def stop_recorded(trainer) -> bool:
    """Whether this process has a SIGTERM or Ctrl-C recorded to stop the fit at the end of the step under way (a
    callback's ``StopRequests``, ``RunCheckpoint.stops``)."""
    return any(getattr(getattr(callback, "stops", None), "signum", None) for callback in trainer.callbacks)
