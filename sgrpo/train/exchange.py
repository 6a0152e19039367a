"""``model.balance_batch``: a step's rows moved between data-parallel processes before the update, so that each
process trains on an even share of the step's work (the step waits for the slowest process).

``BalancedRows.balanced`` runs at the start of ``PolicyUpdate.update``: after the advantages (computed per group,
on the process that sampled it) and before the old and reference log-probs and any mini-batch, so the whole step
is balanced before it is cut, as verl 0.6.1 does. Every process all-gathers every process's rows (gloo has no
all-to-all: each tensor padded to the largest shape, with the shapes first; strings and episodes as objects),
joins them in process order (``RolloutBatch.cat``) and keeps its share (``sgrpo.train.balance.place``):

* ``"rows"`` (verl's ``balance_batch``): every row placed by verl's workload (``verl_workload`` of its real
  tokens), as many rows on every process, each process's rows in verl's order (small, large, small). Rows of a
  group then train on several processes: the batch handed on is one "group" per row (``group_size`` 1, each
  row's advantage, its keep flag, its truncation flag); single-turn only;
* ``"groups"``: whole groups move (their multi-turn trajectories and every row of them), each costed by the packed
  cost model (``sgrpo.train.batching.group_cost``), as many groups on every process, so a group's block mask
  (``share_prompts``) and a trajectory as one sequence (``sgrpo.train.sequences``) hold.

What moves is everything the update reads per row: ids, attention and completion masks, the sampler's log-probs and
nucleus mass, versions (async), trajectory index, truncation, completions, episodes, advantages and keep flags. The
step's metrics by prompt (rewards, budget by difficulty) stay those of the groups each process sampled.

A process that fails preparing its rows tells the others before any data collective (``any_process``), so every
process raises instead of one waiting in an all-gather; an error inside a collective is ``fail_fast``'s.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from sgrpo.distributed import any_process, world_size
from sgrpo.train.balance import imbalance, place, verl_workload
from sgrpo.train.batching import group_cost
from sgrpo.types import RolloutBatch

MODES = (None, "rows", "groups")


def balance_mode(setting: Any) -> str | None:
    """``model.balance_batch`` as a mode: null/false (each process trains its own rows), true or "rows" (verl's),
    "groups"; anything else is refused in one line."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return "rows"
    if setting in MODES:
        return setting
    raise ValueError(f"model.balance_batch must be null/false, 'rows' (or true: verl's) or 'groups', got {setting!r}")


def balance_error(mode: str | None, environment: Any) -> str | None:
    """Why ``mode`` cannot work with the rest of the config, in one line (None: it can)."""
    if mode == "rows" and environment is not None:
        return ("model.balance_batch: 'rows' moves single rows, which would split a multi-turn trajectory's rows and "
                "episode (model.environment) over processes: use 'groups' (whole groups move) or null")  # fmt: skip
    return None


def collective_device() -> torch.device:
    """Where the default process group's collectives take tensors: the current CUDA device under NCCL, else the
    CPU (gloo)."""
    if "nccl" in str(torch.distributed.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(tensors: list[Tensor], device: torch.device) -> list[list[Tensor]]:
    """For each of ``tensors`` (any shapes, which may differ between processes), every process's, in process order.

    One all-gather of the shapes, then one per tensor padded to the largest shape (bools travel as uint8)."""
    world = world_size()
    dims = max(t.dim() for t in tensors)
    shapes = torch.zeros(len(tensors), dims, dtype=torch.long, device=device)
    for i, t in enumerate(tensors):
        shapes[i, : t.dim()] = torch.tensor(t.shape, dtype=torch.long, device=device)
    all_shapes = [torch.empty_like(shapes) for _ in range(world)]
    torch.distributed.all_gather(all_shapes, shapes)
    all_shapes = [s.cpu() for s in all_shapes]
    out = []
    for i, t in enumerate(tensors):
        largest = torch.stack([s[i, : t.dim()] for s in all_shapes]).amax(0).tolist()
        sent = t.to(device, torch.uint8 if t.dtype == torch.bool else t.dtype)
        padded = sent.new_zeros(largest)
        padded[tuple(slice(0, n) for n in t.shape)] = sent
        received = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(received, padded)
        out.append([
            r[tuple(slice(0, int(n)) for n in s[i, : t.dim()])].to(t.device, t.dtype)
            for r, s in zip(received, all_shapes)
        ])  # fmt: skip
    return out


class BalancedRows:
    """Mixed into ``PolicyUpdate``; reads the policy's ``balance_batch``, ``mask_truncated``, ``model`` and the
    packing verdicts (``MicroBatchLogprobs``)."""

    def balanced(
        self, rollout: RolloutBatch, advantages: Tensor, keep_groups: Tensor
    ) -> tuple[RolloutBatch, Tensor, Tensor, dict[str, float]]:
        """This process's share of the step's rows (module docstring): the rollout, its advantages ``[B', G']``,
        its keep flags ``[B']`` and the imbalance metrics; the arguments unchanged (no metrics) when
        ``balance_batch`` is off or there is one process. Every process must call it (collectives)."""
        mode = balance_mode(getattr(self, "balance_batch", None))
        if mode is None or world_size() == 1:
            return rollout, advantages, keep_groups, {}
        device, error = collective_device(), None
        try:
            local = self._exchanged_payload(rollout, advantages, keep_groups)
        except Exception as err:  # noqa: BLE001 - told to the others first, then raised
            error = err
        if any_process(error is not None, device):
            if error is not None:
                raise error
            raise RuntimeError("model.balance_batch: another process failed preparing its rows for the exchange")
        tensors, objects = local
        gathered = all_gather_rows(tensors, device)
        everyone: list[Any] = [None] * world_size()
        torch.distributed.all_gather_object(everyone, objects)
        batches, adv, keep = _rebuild(rollout, gathered, everyone)
        return self._share(mode, batches, adv, keep, torch.distributed.get_rank())

    def _exchanged_payload(
        self, rollout: RolloutBatch, advantages: Tensor, keep_groups: Tensor
    ) -> tuple[list[Tensor], dict[str, Any]]:
        """This process's rows as the tensors ``all_gather_rows`` moves and the objects ``all_gather_object`` moves.
        Optional fields are absent alike on every process (one engine samples for all); multi-turn episodes always
        send their rows' trajectories (a process none of whose episodes continued in a new row has none of its own,
        while another's may: else the processes would send different numbers of tensors)."""
        fields = {name: getattr(rollout, name) for name in OPTIONAL}
        if rollout.episodes is not None:
            fields["trajectory"] = rollout.row_trajectory()
        per_row = [rollout.input_ids, rollout.attention_mask, rollout.completion_mask]
        per_row += [value for value in fields.values() if value is not None]
        per_trajectory = [rollout.truncated, advantages.reshape(-1),
                          keep_groups.bool().repeat_interleave(rollout.group_size)]  # fmt: skip
        present = [fields[name] is not None for name in OPTIONAL]
        objects = {"completions": rollout.completions, "episodes": rollout.episodes, "present": present}
        return per_row + per_trajectory, objects

    def _share(
        self, mode: str, batches: list[RolloutBatch], adv: Tensor, keep: Tensor, rank: int
    ) -> tuple[RolloutBatch, Tensor, Tensor, dict[str, float]]:
        """Process ``rank``'s rows of the joined ``batches`` (one per process; ``adv``, ``keep`` per trajectory),
        placed by ``mode``, and the imbalance of the real tokens the gradient pass runs before and after."""
        joined, world, g = RolloutBatch.cat(batches), len(batches), batches[0].group_size
        if mode == "rows" and joined.trajectory is not None:
            raise ValueError(balance_error("rows", "multi-turn rows"))
        token_mask = joined.completion_mask & joined.per_row(keep).unsqueeze(-1)
        if self.mask_truncated:
            token_mask = token_mask & ~joined.per_row(joined.truncated).unsqueeze(-1)
        runs = token_mask.any(-1)  # rows the gradient pass runs: with loss, and not skipped at advantage 0
        if getattr(getattr(self, "loss", None), "zero_at_zero_advantage", False):
            runs = runs & (joined.per_row(adv) != 0).to(runs.device)
        tokens = (joined.attention_mask.sum(-1) * runs).tolist()
        starts = [0, *itertools.accumulate(len(b.completions) for b in batches)]
        before = [sum(tokens[r] for r in _rows_of(joined, range(starts[p], starts[p + 1]))) for p in range(world)]
        if mode == "rows":  # verl: each row with loss by its workload, whatever the loss skips
            lengths = (joined.attention_mask.sum(-1) * token_mask.any(-1)).tolist()
            shares = place([verl_workload(int(n)) for n in lengths], world, verl_layout=True)
            own = _single_rows(joined, torch.tensor(shares[rank], dtype=torch.long, device="cpu"), adv, keep)
            after = [sum(tokens[r] for r in s) for s in shares]
        else:
            rows_of = [_rows_of(joined, range(b * g, (b + 1) * g)) for b in range(joined.num_groups)]
            shares = place(self._group_costs(joined, rows_of, token_mask, runs), world, verl_layout=False)
            mine = torch.tensor(shares[rank], dtype=torch.long, device="cpu")
            on = mine.to(adv.device)
            own = (joined.select_groups(mine), adv.view(-1, g)[on], keep.view(-1, g)[on, 0])
            after = [sum(tokens[r] for b in s for r in rows_of[b]) for s in shares]
        logs = {"train/update/token_imbalance_before": imbalance(before),
                "train/update/token_imbalance_after": imbalance(after)}  # fmt: skip
        return (*own, logs)

    def _group_costs(self, joined: RolloutBatch, rows_of: list[list[int]], token_mask: Tensor, runs: Tensor) -> list:
        """Each group's modelled update cost (``group_cost``, the packed cost model): a forward and backward (3
        units) of the rows the gradient pass runs, per PPO epoch, plus a forward (1 unit) of every row with loss
        per no-grad pass (the proximal log-probs where more than one optimiser step runs, the reference's)."""
        packs = self._packs(self.model)
        # a group's prompt runs once per part where the update shares it, parts of at most micro_batch_size rows
        share, max_rows = self._shares(self.model), getattr(self, "micro_batch_size", None)
        hidden = getattr(self.model.config, "hidden_size", None) if packs else None
        epochs, minibatches = getattr(self, "ppo_epochs", 1), getattr(self, "num_minibatches", 1)
        passes = int(epochs * minibatches > 1) + int(bool(getattr(getattr(self, "loss", None), "needs_reference", 0)))
        running = token_mask & runs.unsqueeze(-1)
        costs = []
        for rows in rows_of:
            index = torch.tensor(rows, dtype=torch.long, device="cpu")
            no_grad = group_cost(joined, index, token_mask, hidden, share, max_rows) if passes else 0.0
            costs.append(3 * epochs * group_cost(joined, index, running, hidden, share, max_rows) + passes * no_grad)
        return costs


#: the rollout's optional per-row tensors, moved when present
OPTIONAL = ("logprobs", "nucleus_mass", "versions", "trajectory", "newest_versions")


def _rebuild(
    rollout: RolloutBatch, gathered: list[list[Tensor]], objects: list[dict[str, Any]]
) -> tuple[list[RolloutBatch], Tensor, Tensor]:
    """Every process's ``RolloutBatch`` from ``all_gather_rows``' output, and the advantages and keep flags of the
    joined trajectories (process order)."""
    present = objects[0]["present"]
    names = [name for name, there in zip(OPTIONAL, present) if there]
    batches, adv, keep = [], [], []
    for p, sent in enumerate(objects):
        ids, attention, completion, *rest = (column[p] for column in gathered)
        optional, (truncated, advantages, kept) = dict(zip(names, rest[: len(names)])), rest[len(names) :]
        batches.append(RolloutBatch(
            input_ids=ids, attention_mask=attention, completion_mask=completion, completions=sent["completions"],
            truncated=truncated, group_size=rollout.group_size, episodes=sent["episodes"], **optional,
        ))  # fmt: skip
        adv.append(advantages)
        keep.append(kept)
    return batches, torch.cat(adv), torch.cat(keep)


def _rows_of(batch: RolloutBatch, trajectories: range) -> list[int]:
    """The rows of ``trajectories`` (indices of trajectories) in ``batch``."""
    if batch.trajectory is None:
        return list(trajectories)
    wanted = set(trajectories)
    return [r for r, t in enumerate(batch.trajectory.tolist()) if t in wanted]


def _single_rows(batch: RolloutBatch, rows: Tensor, adv: Tensor, keep: Tensor) -> tuple[RolloutBatch, Tensor, Tensor]:
    """``rows`` of a single-turn ``batch`` in that order as a batch of one-row groups (``group_size`` 1), with each
    row's advantage ``[n, 1]`` and keep flag ``[n]``."""
    on = rows.to(batch.input_ids.device)
    pick = lambda x: None if x is None else x[rows.to(x.device)]  # noqa: E731
    own = RolloutBatch(
        input_ids=batch.input_ids[on], attention_mask=batch.attention_mask[on],
        completion_mask=batch.completion_mask[on], completions=[batch.completions[i] for i in rows.tolist()],
        truncated=pick(batch.truncated), group_size=1, logprobs=pick(batch.logprobs),
        nucleus_mass=pick(batch.nucleus_mass), versions=pick(batch.versions),
        newest_versions=pick(batch.newest_versions),
    )  # fmt: skip
    return own, adv[rows.to(adv.device)].unsqueeze(-1), keep[rows.to(keep.device)]
