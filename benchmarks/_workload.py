"""The two sides of ``benchmarks/throughput.py``: one framework per process, stepped by the parent.

A worker builds its trainer (sgrpo's ``GRPOPolicy`` under Lightning, or TRL's ``GRPOTrainer``) on the
shared model folder and prompts, then blocks at the start of every training step until the parent
writes ``go`` on its stdin. At each step start it first reports the previous step on stdout (a line
``@@bench {json}``): the wall time from release to the next step start (so every framework overhead
between two steps counts), the time spent generating (TRL's ``model.generate``, sgrpo's
``HFRollout._generate_rows``) and the tokens it produced,
and the process's current and peak RSS. A line other than ``go`` ends the process at once.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from sgrpo.types import Example
from tasks.base import Reward, RewardResult

PREFIX = "@@bench "


@dataclass
class Workload:
    """Everything both frameworks must agree on; travels to the workers as JSON."""

    model_dir: str
    prompts: int = 8  # B: prompts per step (the task holds exactly these)
    group_size: int = 8  # G
    new_tokens: int = 32  # max new tokens; also the minimum when force_length
    force_length: bool = False  # True: EOS masked for the first new_tokens tokens (every completion T tokens)
    steps: int = 8  # steps the parent will release
    threads: int = 2
    reward: str = "parity"  # a binary reward with variance for a random model; "exact_match": the sort task's own
    lr: float = 1e-6
    trl_gradient_checkpointing: bool = False
    micro_batch: int | None = None  # rows per forward/backward (gradients accumulated): sgrpo's micro_batch_size
    logits_chunk_mib: float = 128.0  # sgrpo only: its LM-head chunk budget (GRPOPolicy default)
    micro_batch_tokens: int | str | None = "auto"  # sgrpo only: padded tokens per micro-batch ("auto": 1024 on CPU)
    share_prompts: bool = True  # sgrpo only: each prompt's forward once per micro-batch (the padded path's)
    packing: bool = True  # sgrpo only: model.packing, each micro-batch's real tokens packed (False: padded rows)
    lean_mlp: bool = True  # sgrpo only: model.lean_mlp, the MLP's backward recomputes silu(gate) * up
    lean_norm: bool = True  # sgrpo only: model.lean_norm, an RMSNorm's backward recomputes its normalised input
    sgrpo_decoder: str = "lean"  # sgrpo only: HFRollout's decoder ("generate": transformers' generate)
    sgrpo_cuda_graphs: bool = False  # sgrpo only: HFRollout(cuda_graphs=True), fixed-shape steps replayed as graphs
    device: str = "cpu"  # "cuda": both in bf16-mixed (fp32 master weights); peak memory is then the GPU's

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class FirstCharParity(Reward):
    """1 if the first character's code point is odd: a binary reward with variance for a random model."""

    name = "parity"

    def score(self, examples, completions) -> RewardResult:
        total = torch.tensor([float(ord((c.strip() or "0")[0]) % 2) for c in completions], dtype=torch.float32)
        return RewardResult(total, {self.name: total})


def make_task(work: Workload):
    from tasks.synthetic import SyntheticTask

    reward = FirstCharParity() if work.reward == "parity" else None  # None: SyntheticTask's ExactMatch
    return SyntheticTask(kind="sort", num_train=work.prompts, num_validation=0, num_test=0, reward=reward)


class StepGate:
    """Holds the training loop at each step start and times the step that just ended."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.cpu_started = 0.0
        self.gen_s, self.gen_tokens, self.calls = 0.0, 0, 0

    def wrap_generate(self, owner, name: str, eos_ids: list[int], returns_prompt: bool) -> None:
        """Time ``owner.name`` (a function from prompt ids to token ids) and count the new tokens it made.

        TRL: ``model.generate`` (prompt + new tokens back). sgrpo: ``HFRollout._generate_rows`` (the
        lean decoder or ``generate``, new tokens only). Tokens are counted up to and including the first EOS.
        """
        original = getattr(owner, name)

        def generate(*args, **kwargs):
            prompt_len = kwargs["input_ids"].shape[1] if returns_prompt else 0
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            self.gen_s += time.perf_counter() - t0
            ids = out[0] if isinstance(out, tuple) else out  # sgrpo's rows come with their log-probs
            new = ids[:, prompt_len:]  # [N, T]
            is_eos = torch.isin(new, torch.tensor(eos_ids, device=new.device))
            before = (is_eos.long().cumsum(-1) - is_eos.long()) == 0  # up to and including the first EOS
            self.gen_tokens += int(before.sum())
            self.calls += 1
            return out

        setattr(owner, name, generate)

    def at_step_start(self) -> None:
        on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
        if on_gpu:
            torch.cuda.synchronize()  # the step's kernels are done before its time is read
        now = time.perf_counter()
        record = {"rss_mib": _rss_mib(), "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if on_gpu:  # GPU runs compare the GPU's memory: the most allocated at once so far
            record["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        if self.started is not None:
            record |= {
                "wall_s": now - self.started,
                "cpu_s": _cpu_s() - self.cpu_started,
                "gen_s": self.gen_s,
                "gen_tokens": self.gen_tokens,
                "generate_calls": self.calls,
            }
        print(PREFIX + json.dumps(record), flush=True)
        if sys.stdin.readline().strip() != "go":
            sys.stdout.flush()
            os._exit(0)  # skip teardown (export, checkpoint): the parent has what it needs
        self.gen_s, self.gen_tokens, self.calls = 0.0, 0, 0
        self.cpu_started = _cpu_s()
        self.started = time.perf_counter()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sgrpo_policy(work: Workload):
    """sgrpo's side of the workload: GRPOPolicy with the settings both frameworks agree on."""
    from estimators import GRPO
    from sgrpo.policy import GRPOPolicy
    from sgrpo.rollout import HFRollout
    from sgrpo.train.loss import ClippedSurrogate

    rollout = HFRollout(
        max_new_tokens=work.new_tokens, temperature=1.0, decoder=work.sgrpo_decoder, cuda_graphs=work.sgrpo_cuda_graphs
    )
    policy = GRPOPolicy(
        model=work.model_dir,
        task=make_task(work),
        estimator=GRPO(),  # z-score, sample std: TRL's scale_rewards="group"
        rollout=rollout,
        group_size=work.group_size,
        prompts_per_step=work.prompts,
        loss=ClippedSurrogate(aggregation="token_mean", kl_coef=0.0),  # TRL's loss_type="dapo", beta 0
        micro_batch_size=work.micro_batch,
        micro_batch_tokens=work.micro_batch_tokens,
        share_prompts=work.share_prompts,
        packing=work.packing,
        lean_mlp=work.lean_mlp,
        lean_norm=work.lean_norm,
        logits_chunk_mib=work.logits_chunk_mib,
        max_grad_norm=1.0,
        optimizer=lambda params: torch.optim.AdamW(params, lr=work.lr, weight_decay=0.0, fused=True),
    )
    if work.force_length:  # training refuses min_new_tokens (it truncates the distribution): an EOS out of reach
        configure = policy.configure_model

        def configure_model() -> None:
            configure()
            policy.model.generation_config.eos_token_id = policy.model.config.vocab_size  # an id never sampled

        policy.configure_model = configure_model
    return policy



def run_sgrpo(work: Workload) -> None:
    from lightning.pytorch import Callback

    from sgrpo.rollout import eos_ids

    gate = StepGate()

    class Gate(Callback):
        def on_fit_start(self, trainer, pl_module) -> None:
            eos = eos_ids(pl_module.model, pl_module.tokenizer)
            gate.wrap_generate(pl_module.rollout, "_generate_rows", eos, returns_prompt=False)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            gate.at_step_start()

    policy = sgrpo_policy(work)
    # the last step start only reports the one before
    trainer = quiet_trainer(work.steps + 1, Gate(), "sgrpo_bench_", work.device)
    trainer.fit(policy)


def run_trl(work: Workload) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task = make_task(work)
    train = list(task.examples("train"))  # the B prompts sgrpo's StepBatches also yields every step
    examples: dict[str, Example] = {ex.prompt: ex for ex in train}
    scorer = task.reward

    def reward(prompts, completions, **kwargs) -> list[float]:  # the same Reward object sgrpo calls
        return scorer.score([examples[p] for p in prompts], completions).total.tolist()

    reward.__name__ = scorer.name
    gate = StepGate()

    class Gate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            gate.at_step_start()

    tokenizer = AutoTokenizer.from_pretrained(work.model_dir)
    model = AutoModelForCausalLM.from_pretrained(work.model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"),
        # TRL counts completions: B x G rows per optimiser step, in micro-batches of micro_batch rows; one
        # generation per optimiser step (steps_per_generation defaults to gradient_accumulation_steps)
        per_device_train_batch_size=work.micro_batch or work.rows,
        gradient_accumulation_steps=work.rows // (work.micro_batch or work.rows),
        num_generations=work.group_size,
        num_iterations=1,
        max_completion_length=work.new_tokens,
        generation_kwargs={"min_new_tokens": work.new_tokens} if work.force_length else None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        use_vllm=False,
        bf16=work.device == "cuda",  # autocast over fp32 master weights, as sgrpo's bf16-mixed
        fp16=False,
        use_cpu=work.device == "cpu",
        gradient_checkpointing=work.trl_gradient_checkpointing,
        learning_rate=work.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=work.steps + 1,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": ex.prompt} for ex in train]),
        processing_class=tokenizer,
        callbacks=[Gate()],
    )
    gate.wrap_generate(trainer.model, "generate", trainer.eos_token_ids, returns_prompt=True)
    trainer.train()


def worker_main(framework: str, work_json: str) -> None:
    work = Workload(**json.loads(work_json))
    torch.set_num_threads(work.threads)
    torch.manual_seed(0)
    {"sgrpo": run_sgrpo, "trl": run_trl}[framework](work)
    print(PREFIX + json.dumps({"error": "training ended before the parent stopped it"}), flush=True)


def quiet_trainer(max_steps: int, callback, prefix: str, device: str = "cpu"):
    """A Trainer (CPU fp32, or one GPU in bf16-mixed) with no logging, checkpoints, progress bar or validation,
    in a scratch folder."""
    from lightning.pytorch import Trainer

    return Trainer(
        max_steps=max_steps,
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if device == "cuda" else "32-true",

        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tempfile.mkdtemp(prefix=prefix),
    )
