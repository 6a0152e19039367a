"""The stop that the processes of a job agree on during a training rollout (``RolloutStop``): a signal saves the last
step's end at once instead of after a long rollout and update (``sgrpo.run.signals`` records the signal,
``sgrpo.run.faults`` posts it to the other processes)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from sgrpo.distributed import world_size


class RolloutStopped(BaseException):
    """Raised inside a rollout at one of its checks once a stop is requested (``RolloutStop``); caught where the
    rollout was started (``RolloutStop.run``). A BaseException: no ``except Exception`` in a rollout keeps it."""


class RolloutStop:
    """A stop that the processes of a job agree on during a training rollout, without waiting for the step's end.

    The state during the rollout is still the last step's end, which a checkpoint may hold; under several
    processes its save is a collective, so every process must stop at the same point. ``run`` runs the rollout
    with the window open; a signal then calls ``request`` (the signal handler: a flag, nothing else), and the
    process's fault watch posts it in the process group's store (``sgrpo.run.faults.share_stop``), where every
    other watch reads it (``noticed``) within a second. The rollout reads ``requested`` at its checks (``check``):
    a process whose forwards are not collectives leaves its rollout at once (``RolloutStopped``); under FSDP2's
    lockstep decode the flag rides on the all-reduce every process already runs at each check (``decode``), so
    they all leave after the same forward. After the rollout (whole or cut short) every process runs one
    all-reduce (MAX of the signal numbers): the same answer everywhere, the signal to stop with, or 0. A process
    inside a collective of the rollout cannot leave it, and need not: every process reaches that all-reduce, the
    ones that saw no notice after their whole rollout. A signal that arrives after the window closed stops the
    fit at the step's end.
    """

    def __init__(self) -> None:
        self.signum = 0  # the signal this process was asked to stop for (its own, or a notice from the store)
        self.open = False  # a rollout whose state is the last step's end is under way (more than one process)
        self.posted = False  # this process's signal is in the store

    def request(self, signum: int) -> bool:
        """Record ``signum`` (from a signal handler) if the window is open; whether it was."""
        if self.open and not self.signum:
            self.signum = signum
        return self.open

    def noticed(self, signum: int) -> None:
        """Another process asked to stop (read from the store by this process's watch)."""
        if self.open and not self.signum:
            self.signum, self.posted = signum, True

    @property
    def requested(self) -> bool:
        return self.open and bool(self.signum)

    def check(self) -> None:
        """At a safe point of a rollout whose forwards are not collectives: leave it once a stop is requested."""
        if self.requested:
            raise RolloutStopped

    def run(
        self, rollout: Callable[[], Any], device: torch.device, gone: tuple[type[Exception], ...] = ()
    ) -> tuple[Any, int]:
        """``rollout()`` with the window open (more than one process), and the signal every process agreed to stop
        for (0: none; the rollout's result is then complete). A collective: every process calls it. A rollout that
        raises one of ``gone`` (an engine outside the process group failing: vLLM servers, which SLURM's SIGTERM
        reaches too) after this process was asked to stop ends as that stop, not as an error; any other error
        raises (one inside the rollout's own collectives must not meet the all-reduce below)."""
        if world_size() == 1:
            return rollout(), 0
        self.signum, self.open, self.posted = 0, True, False
        result = None
        try:
            result = rollout()
        except RolloutStopped:
            pass
        except gone as err:  # once a stop is asked for: vLLM servers sgrpo launched got the same SIGTERM (SLURM
            if not self.requested:  # signals every process of the job step) and the rollout waiting on them failed
                raise
            print(f"the rollout failed while stopping ({type(err).__name__}: {err}); stopping as asked, at the last "
                  f"step's end", file=sys.stderr, flush=True)  # fmt: skip
        finally:
            self.open = False  # a signal from here on stops at the step's end
        value = torch.tensor(float(self.signum), device=device)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        self.signum = 0
        return result, int(value.item())


#: this process's rollout stop (the signal handler, the fault watch and the rollout's checks share it)
ROLLOUT_STOP = RolloutStop()
