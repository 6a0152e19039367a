"""Where sgrpo's step time goes, for ``benchmarks/throughput.py --case profile`` (split from
``benchmarks/_workload.py``, whose workload and trainer it profiles): the step's phases as a tree, then the top
torch ops. On a GPU (``--device cuda``) each phase's timer first waits for the GPU (``torch.cuda.synchronize``), so a
phase is charged with its kernels rather than the next one's, and the top ops are ranked by their GPU time."""

from __future__ import annotations

import time

import torch

from benchmarks._workload import Workload, _cpu_s, quiet_trainer, sgrpo_policy

# ------------------------------------------------------------------------------------------- profile
PHASES = (  # (label, depth): the tree printed by profile_sgrpo, children indented under their parent
    ("step (batch start to next batch start)", 0),
    ("training_step", 1),
    ("rollout: HFRollout.generate", 2),
    ("decode: HFRollout._generate_rows", 3),
    ("tokenize, decode, copies", 3),
    ("score: reward + success", 2),
    ("update", 2),
    ("micro-batch plan (_micro_batches)", 3),
    ("log-probs with gradient (_chunk_logprobs)", 3),
    ("pack (sgrpo.model.packing.pack)", 4),
    ("model forward (final_hidden_states)", 4),
    ("trim, layout, LM head, scatter", 4),
    ("loss (PolicyLoss)", 3),
    ("manual_backward", 3),
    ("_optimizer_step (norm, clip, AdamW, zero_grad)", 3),
    ("update: rest (old/reference log-probs, masks, counts, stats)", 3),
    ("self.log / log_dict calls", 2),
    ("training_step: rest (estimator, metrics)", 2),
    ("Lightning loop between steps", 1),
)


def profile_sgrpo(work: Workload, warmup: int, top_ops: int = 15) -> None:
    """Run sgrpo's steps in this process with timers on its phases; print medians and torch's top ops."""
    import functools
    import statistics

    from lightning.pytorch import Callback

    import sgrpo.model.logprobs as logprobs_module

    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}

    gradient_pass: list[bool] = [False]  # inside a _chunk_logprobs of the gradient pass (its ``stats`` given)

    cuda = work.device == "cuda"

    def timed(name, fn, when=lambda *args, **kwargs: True):
        """``fn`` with its time added to ``name``'s, on the calls where ``when(*args, **kwargs)``."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not when(*args, **kwargs):
                return fn(*args, **kwargs)
            if cuda:  # the kernels queued before this phase are not its own
                torch.cuda.synchronize()
            w0, c0 = time.perf_counter(), _cpu_s()
            try:
                return fn(*args, **kwargs)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                wall[name] = wall.get(name, 0.0) + time.perf_counter() - w0
                cpu[name] = cpu.get(name, 0.0) + _cpu_s() - c0

        return wrapper

    policy = sgrpo_policy(work)
    patched = [  # module functions, restored after the run; timed in the gradient pass only (the rollout's
        # prefill and the no-gradient passes call them too)
        (logprobs_module, "pack", "pack (sgrpo.model.packing.pack)"),
        (logprobs_module, "final_hidden_states", "model forward (final_hidden_states)"),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, label in patched:
        setattr(module, name, timed(label, getattr(module, name), lambda *a, **k: gradient_pass[0]))
    chunk_logprobs = policy._chunk_logprobs

    def gradient_chunk(model, rollout, chunk, token_mask, stats=None):
        gradient_pass[0] = stats is not None
        try:
            return chunk_logprobs(model, rollout, chunk, token_mask, stats)
        finally:
            gradient_pass[0] = False

    policy._chunk_logprobs = timed("log-probs with gradient (_chunk_logprobs)", gradient_chunk,
                                   lambda *a, **k: len(a) > 4 and a[4] is not None)
    for attr, name in [
        ("training_step", "training_step"),
        ("score", "score: reward + success"),
        ("update", "update"),
        ("_micro_batches", "micro-batch plan (_micro_batches)"),
        ("manual_backward", "manual_backward"),
        ("_optimizer_step", "_optimizer_step (norm, clip, AdamW, zero_grad)"),
        ("log", "self.log / log_dict calls"),  # log_dict calls self.log once per key
    ]:
        setattr(policy, attr, timed(name, getattr(policy, attr)))
    policy.loss = _TimedLoss(policy.loss, timed)
    policy.rollout.generate = timed("rollout: HFRollout.generate", policy.rollout.generate)
    records: list[tuple[dict, dict]] = []
    marks: dict[str, float] = {}
    profiled: list = []  # the profiler of the last step (not among the timed ones)

    class Phases(Callback):
        def on_fit_start(self, trainer, pl_module) -> None:
            rollout = pl_module.rollout
            rollout._generate_rows = timed("decode: HFRollout._generate_rows", rollout._generate_rows)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if marks:
                wall[PHASES[0][0]] = time.perf_counter() - marks["wall"]
                cpu[PHASES[0][0]] = _cpu_s() - marks["cpu"]
                records.append((dict(wall), dict(cpu)))
            wall.clear(), cpu.clear()
            if len(records) == work.steps:  # the last step: profiled inside the fit (device, autocast as trained)
                profiled.append(_profiler(cuda))
                profiled[0].__enter__()
            marks.update(wall=time.perf_counter(), cpu=_cpu_s())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if profiled:
                if cuda:
                    torch.cuda.synchronize()
                profiled[0].__exit__(None, None, None)

    trainer = quiet_trainer(work.steps + 1, Phases(), "sgrpo_profile_", work.device)
    trainer.fit(policy)
    for module, name, original in originals:
        setattr(module, name, original)
    measured = records[warmup:]
    for times in (t for pair in measured for t in pair):
        _derive_phases(times)
    step_wall = statistics.median(w[PHASES[0][0]] for w, _ in measured)
    print(f"\n### sgrpo step phases: median of {len(measured)} steps after {warmup} warm-up, {work.threads} threads\n")
    print("| phase | wall (s) | share of step | process CPU (s) |\n|---|---:|---:|---:|")
    for label, depth in PHASES:
        w = statistics.median(r[0].get(label, 0.0) for r in measured)
        c = statistics.median(r[1].get(label, 0.0) for r in measured)
        print(f"| {'&nbsp;&nbsp;' * depth}{label} | {w:.3f} | {w / step_wall:.1%} | {c:.3f} |")
    _top_ops(profiled[0], top_ops, cuda)


def _derive_phases(times: dict[str, float]) -> None:
    """Add the untimed phases: a parent's time minus its timed children."""

    def total(*keys: str) -> float:
        return sum(times.get(k, 0.0) for k in keys)

    times["tokenize, decode, copies"] = total("rollout: HFRollout.generate") - total("decode: HFRollout._generate_rows")
    # _chunk_logprobs runs in the gradient pass and in the no-gradient passes (old, reference): only the former is
    # timed, and the pack and forward within it
    chunk, forward, pack = (total(PHASES[i][0]) for i in (8, 10, 9))
    times[PHASES[11][0]] = chunk - forward - pack
    times[PHASES[15][0]] = total("update") - total(*(PHASES[i][0] for i in (7, 8, 12, 13, 14)))
    times["training_step: rest (estimator, metrics)"] = total("training_step") - total(
        "rollout: HFRollout.generate", "score: reward + success", "update", "self.log / log_dict calls"
    )
    times["Lightning loop between steps"] = total(PHASES[0][0]) - total("training_step")


class _TimedLoss:
    """A ``PolicyLoss`` whose calls are timed (every other attribute is the loss's own)."""

    def __init__(self, loss, timed) -> None:
        self.__dict__["_loss"], self.__dict__["_call"] = loss, timed("loss (PolicyLoss)", loss.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._loss, name)


def _profiler(cuda: bool):
    """torch.profiler over CPU operators, and the GPU's kernels on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])


def _top_ops(prof, limit: int, cuda: bool = False) -> None:
    """torch.profiler's top operators over the fit's last step (rollout + update, inside Lightning's loop: after the
    fit Lightning moves the model to the CPU): by self CPU time, or on a GPU by self GPU time."""
    sort, unit = ("self_device_time_total", "GPU") if cuda else ("self_cpu_time_total", "CPU")
    print(f"\n### torch.profiler, one more step (rollout + update), top {limit} operators by self {unit} time\n")
    print(prof.key_averages().table(sort_by=sort, row_limit=limit))
