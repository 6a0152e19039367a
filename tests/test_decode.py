"""The lean rollout decoder against transformers' forward and generate, and its sampler against exact probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sgrpo.model.logprobs import completion_logprobs, position_ids_from_mask
from sgrpo.model.tiny import ensure_tiny_model
from sgrpo.rollout import HFRollout
from sgrpo.rollout.decode import LlamaFamilyStep, decode, kv_cache
from sgrpo.rollout.sampling import sample
from tasks.synthetic import SyntheticTask
from tests.engine_helpers import EXAMPLES

VOCAB = 40
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, pad_token_id=0,
)  # fmt: skip


def _models():
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**COMMON)),
        "llama_bias": LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**COMMON)),  # q/k/v biases
        "qwen3": Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)),  # q/k norms, explicit head_dim
        "mistral": MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
    }


def _prompts(generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of lengths 5, 3, 1 over tokens 2..VOCAB-1."""
    ids = torch.randint(2, VOCAB, (3, 5), generator=generator)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", ["llama", "llama_bias", "qwen2", "qwen3", "mistral"])
def test_native_step_matches_the_model_forward(name):
    """Token by token, the native decode step's logits equal the HF forward's over the whole sequence."""
    torch.manual_seed(0)
    model = _models()[name].eval()
    with torch.no_grad():  # random biases (zero-initialised by HF) so they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    assert LlamaFamilyStep.supported(model)
    ids, mask = _prompts(torch.Generator().manual_seed(1))
    rows = torch.tensor([0, 0, 1, 2])
    steps = 6
    with torch.no_grad():
        cache = kv_cache(model, ids.shape[1] + steps, block=4)  # grown twice on the way
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), past_key_values=cache)
        for layer in cache.layers:
            layer.batch_select_indices(rows)
        native = LlamaFamilyStep(model, cache, ids.shape[1] + steps)
        seq, seq_mask = ids[rows], mask[rows]
        position = mask.sum(-1)[rows]
        new = torch.randint(2, VOCAB, (len(rows), steps), generator=torch.Generator().manual_seed(2))
        for t in range(steps):
            seq = torch.cat([seq, new[:, t : t + 1]], 1)
            seq_mask = torch.cat([seq_mask, torch.ones(len(rows), 1, dtype=torch.long)], 1)
            got = native(new[:, t], position + t, seq_mask.bool())
            want = model(input_ids=seq, attention_mask=seq_mask, position_ids=position_ids_from_mask(seq_mask))
            torch.testing.assert_close(got, want.logits[:, -1], atol=2e-5, rtol=1e-5)


def test_a_bf16_models_native_step_samples_the_trained_policy():
    """A bf16 model whose attention logits are large (q and k weights of std 0.5): the native step's log-probs are
    the trainer's forward's to the model's own step's gap. Its scores were rounded to bf16 before the softmax (the
    trainer's SDPA keeps them in float32): a mean gap of 0.0024 here, against 0.00005 for the model's own step."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
                            "max_position_embeddings": 128})  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.normal_(0, 0.5)
    model = model.to(torch.bfloat16)
    ids = torch.randint(2, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    mask, rows = torch.ones_like(ids), torch.arange(2).repeat_interleave(4)
    gaps = {}
    for native in (True, False):
        torch.manual_seed(5)
        with torch.no_grad():
            tokens, logprobs = decode(model, ids, mask, rows, 32, [1], 0, temperature=1.0, native_step=native)
            done = torch.cat([torch.ones(len(rows), 1, dtype=torch.bool), (tokens[:, :-1] != 1).cummin(-1).values], 1)
            full = torch.cat([mask[rows], done.long()], 1)
            trained, _ = completion_logprobs(model, torch.cat([ids[rows], tokens], 1), full, done, share_prompts=False)
        gaps[native] = float((logprobs - trained)[done].abs().mean())
    assert gaps[True] < 2 * gaps[False] + 1e-4, gaps


@pytest.mark.parametrize("native_step", [True, False])
@pytest.mark.parametrize(("compact_below", "check_every"), [(0.0, 1), (0.75, 1), (1.0, 1), (0.75, 3), (1.0, 5)])
def test_greedy_decode_equals_transformers_generate(native_step, compact_below, check_every):
    """Greedy tokens are transformers' greedy tokens, with and without dropping finished rows, whether the
    running rows are read at every token or every few (a cache grown in blocks of 4 positions)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    ids, mask = _prompts(torch.Generator().manual_seed(3))
    rows = torch.tensor([0, 0, 1, 1, 2, 2])
    eos = [1, 5, 9]  # several stop tokens so rows finish at different steps
    got, _ = decode(
        model, ids, mask, rows, 12, eos, pad=0, greedy=True, native_step=native_step, compact_below=compact_below,
        check_every=check_every, cache_block=4,
    )  # fmt: skip
    out = model.generate(
        input_ids=ids[rows], attention_mask=mask[rows], do_sample=False, max_new_tokens=12,
        eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    want = out[:, ids.shape[1] :]
    want = torch.nn.functional.pad(want, (0, 12 - want.shape[1]), value=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    finished = torch.isin(got, torch.tensor(eos)).any(-1)
    assert finished.any() and not finished.all()  # the case exercises early stops and full-length rows


def test_min_new_tokens_masks_eos_and_rows_stop_after_eos():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    with torch.no_grad():
        model.lm_head.weight[1] += 5.0 * model.model.norm.weight.sign()  # EOS likely at every step
    ids, mask = _prompts(torch.Generator().manual_seed(4))
    rows = torch.arange(3).repeat_interleave(8)
    torch.manual_seed(5)
    tokens, _ = decode(model, ids, mask, rows, 10, [1], pad=0, min_new_tokens=4)
    is_eos = tokens == 1
    assert not is_eos[:, :4].any()
    first = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.full((len(rows),), 10))
    assert (first < 10).sum() >= 12  # most rows stopped early
    after = torch.arange(10).unsqueeze(0) > first.unsqueeze(-1)
    assert (tokens[after] == 0).all()  # pad after EOS


def test_sampler_draws_from_the_truncated_softmax():
    """Frequencies of 200,000 draws match softmax(logits / T) cut to top-k then top-p (chi-square bound)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    temperature, n = 0.7, 200_000
    p = (logits / temperature).softmax(-1)
    cases = {
        (0, 1.0): p,
        (3, 1.0): torch.cat([p[:3] / p[:3].sum(), torch.zeros(3)]),
    }
    # top-p 0.8: the smallest prefix with mass >= 0.8
    keep = (p.cumsum(-1) - p) < 0.8
    cases[(0, 0.8)] = torch.where(keep, p, torch.zeros_like(p)) / p[keep].sum()
    torch.manual_seed(0)
    for (k, top_p), want in cases.items():
        draws, _ = sample(logits.expand(n, -1), temperature, k, top_p, greedy=False)
        counts = torch.bincount(draws, minlength=6).double()
        assert (counts[want == 0] == 0).all(), (k, top_p)
        expected = want.double()[want > 0] * n
        chi2 = ((counts[want > 0] - expected) ** 2 / expected).sum()
        assert chi2 < 25, (k, top_p, counts, want)  # df <= 5: P(chi2 > 25) < 2e-4
    greedy, mass = sample(logits.expand(4, -1), 1.0, 0, 1.0, greedy=True)
    torch.testing.assert_close(greedy, torch.zeros(4, dtype=torch.long), rtol=0, atol=0)
    assert mass.tolist() == [1.0] * 4


def test_nucleus_keeps_the_smallest_top_set_reaching_top_p_and_reports_its_mass():
    """p = [0.5, 0.3, 0.15, 0.05]: top-p 0.7 keeps {0, 1} (mass 0.8), 0.9 keeps {0, 1, 2} (0.95), 1.0 all (1);
    20,000 draws never leave the nucleus."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    torch.manual_seed(0)
    for top_p, kept, want in ((0.7, 2, 0.8), (0.9, 3, 0.95), (1.0, 4, 1.0)):
        draws, mass = sample(logits.expand(20_000, -1), 1.0, 0, top_p, greedy=False)
        assert int(draws.max()) == kept - 1 and set(draws.tolist()) == set(range(kept)), top_p
        torch.testing.assert_close(mass, torch.full((20_000,), want), atol=1e-6, rtol=0)


def test_unsupported_models_use_the_model_forward():
    """A sliding-window model is decoded through its own forward and still matches generate."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=3)).eval()
    assert not LlamaFamilyStep.supported(model)
    ids, mask = _prompts(torch.Generator().manual_seed(6))
    rows = torch.tensor([0, 1, 2])
    got, _ = decode(model, ids, mask, rows, 6, [1], pad=0, greedy=True)
    out = model.generate(
        input_ids=ids[rows], attention_mask=mask[rows], do_sample=False, max_new_tokens=6, min_new_tokens=6,
        eos_token_id=[1], pad_token_id=0,
    )  # fmt: skip
    torch.testing.assert_close(got[:, : out.shape[1] - ids.shape[1]], out[:, ids.shape[1] :], rtol=0, atol=0)


def test_hf_rollout_decoders_agree(tmp_path):
    """HFRollout's lean decoder and its transformers-generate decoder give the same greedy batch."""
    from transformers import AutoTokenizer

    tiny_model_dir = ensure_tiny_model(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batches = [
        HFRollout(max_new_tokens=8, decoder=d, max_batch_rows=5).generate(model, tokenizer, EXAMPLES, 3, greedy=True)
        for d in ("lean", "generate")
    ]
    for field in ("input_ids", "attention_mask", "completion_mask", "truncated"):
        torch.testing.assert_close(getattr(batches[0], field), getattr(batches[1], field), rtol=0, atol=0,
                                   msg=lambda m, field=field: f"{field}: {m}")
    assert batches[0].completions == batches[1].completions
    with pytest.raises(ValueError, match="decoder"):
        HFRollout(decoder="vllm")
    with pytest.raises(ValueError, match="min_new_tokens"):
        HFRollout(max_new_tokens=4, min_new_tokens=5)


@pytest.mark.parametrize("name", ["llama_bias", "qwen2", "qwen3", "mistral"])
def test_shared_prompt_update_matches_the_full_forward(name):
    """The update's prompt sharing (sgrpo.train.loss) on the same architectures: log-probs and gradients as the full
    forward's (Llama itself, with the call counts, is in tests/test_loss.py)."""
    from sgrpo.model.logprobs import completion_logprobs

    torch.manual_seed(0)
    model = _models()[name].train()
    g = torch.Generator().manual_seed(0)
    prompts, prompt_mask = _prompts(g)
    rows = torch.tensor([0, 0, 0, 1, 1, 2])
    completions = torch.randint(2, VOCAB, (6, 4), generator=g)
    cmask = torch.arange(4).unsqueeze(0) < torch.tensor([4, 2, 3, 4, 1, 4]).unsqueeze(-1)
    ids = torch.cat([prompts[rows], completions], 1)
    attn = torch.cat([prompt_mask[rows], cmask.long()], 1)
    results = []
    for share in (False, True):
        model.zero_grad()
        logp, _ = completion_logprobs(model, ids, attn, cmask, share_prompts=share)
        logp.sum().backward()
        results.append((logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    assert float((results[1][1] - results[0][1]).norm() / results[0][1].norm()) < 1e-5


def test_sampler_and_loss_share_one_head_under_bf16_autocast():
    """Under bf16-mixed the rollout runs in autocast: its LM head must be the loss's (float32 weights, outside
    autocast), or it samples from one policy and trains another. Each row's first token comes from the
    prompt's prefill, the same computation as the loss's forward up to that position: their log-probs agree
    exactly (a bf16 head was off by up to ~1e-2), and over all tokens the gap is float noise of the body."""
    model_dir = Path(__file__).resolve().parents[1] / "sgrpo" / "assets" / "quickstart_model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = SyntheticTask(kind="sort", levels=[3, 5, 7], num_train=32, num_validation=4).examples("train")[:8]
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batch = HFRollout(max_new_tokens=9).generate(model, tokenizer, examples, 4)
        with torch.no_grad():
            logp, _ = completion_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert batch.logprobs is not None and batch.logprobs.dtype == torch.float32
    gap = (logp - batch.logprobs).abs()
    assert float(gap[:, 0].max()) < 1e-6
    assert float(gap[batch.completion_mask].mean()) < 5e-3
    assert (batch.logprobs[~batch.completion_mask] == 0).all()


@pytest.mark.parametrize("autocast", [False, True])
def test_rollout_on_a_weights_snapshot_samples_the_same_policy(autocast):
    """``weights_snapshot=True`` decodes on a copy made once per rollout (Linear weights cast once to
    autocast's dtype, the LM head kept in float32): the same tokens and log-probs as decoding through the
    model, where autocast casts each weight at each use, and the copy's memory is released afterwards."""
    model_dir = Path(__file__).resolve().parents[1] / "sgrpo" / "assets" / "quickstart_model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = SyntheticTask(kind="sort", levels=[3, 5, 7], num_train=32, num_validation=4).examples("train")[:8]
    batches = []
    for snapshot in (False, True):
        rollout = HFRollout(max_new_tokens=9, weights_snapshot=snapshot)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            batches.append(rollout.generate(model, tokenizer, examples, 4))
    torch.testing.assert_close(batches[0].input_ids, batches[1].input_ids, rtol=0, atol=0)
    torch.testing.assert_close(batches[0].logprobs, batches[1].logprobs, rtol=0, atol=0)
    shell = rollout._weights._shell
    assert shell is not None and all(p.device.type == "meta" for p in shell.parameters())  # memory given back
    linear_dtypes = {m.weight.dtype for m in shell.modules() if isinstance(m, torch.nn.Linear)}
    assert linear_dtypes == ({torch.bfloat16, torch.float32} if autocast else {torch.float32})  # head: float32


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("compact_below", [0.0, 0.75, 1.0])
def test_fixed_shape_steps_for_cuda_graphs_match_the_eager_decoder(name, compact_below):
    """``cuda_graphs=True`` runs the fixed-shape steps (sgrpo.rollout.graphs; eager on CPU, graph replay on CUDA):
    keys and values written at a column held in a tensor, attention over the whole capacity under a key
    mask, finished rows moved to the front and steps padded to power-of-two buckets. Same sampled tokens
    (same seed) and log-probs as the eager decoder, with rows stopping at different steps."""
    torch.manual_seed(0)
    model = _models()[name].eval()
    ids, mask = _prompts(torch.Generator().manual_seed(3))
    rows = torch.arange(3).repeat_interleave(8)  # 24 rows: some end early, some run to the end
    eos = [1, 5, 9]
    runs = []
    for graphs in (False, True):
        torch.manual_seed(4)
        runs.append(decode(model, ids, mask, rows, 12, eos, pad=0, compact_below=compact_below, cuda_graphs=graphs))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-5, rtol=1e-5)
    finished = torch.isin(runs[0][0], torch.tensor(eos)).any(-1)
    assert finished.any() and not finished.all()


def test_buckets_are_powers_of_two_up_to_the_batch():
    from sgrpo.rollout.graphs import bucket

    assert [bucket(n, 12) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]



def test_graph_capture_reports_only_this_threads_unsafe_calls(monkeypatch):
    """The capture of a bucket's step (CUDA's branch, its calls recorded on CPU) uses
    ``capture_error_mode="thread_local"``: under "global" (torch's default) another thread's CUDA call (the reward
    pool's, a logger's) while the step is recorded breaks the capture."""
    import contextlib
    from types import SimpleNamespace

    from sgrpo.rollout.graphs import StaticSteps, capture_graph

    captured = {}

    class Graph:
        def pool(self):
            return "pool"

    def graph(g, pool=None, **kwargs):
        captured.update(kwargs, pool=pool)
        return contextlib.nullcontext()

    stream = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: contextlib.nullcontext())
    steps = StaticSteps.__new__(StaticSteps)
    steps._pool, runs = None, []
    steps._run = lambda b: runs.append(b) or torch.zeros(b, 3)
    _, out = capture_graph(steps, 4)
    assert captured == {"capture_error_mode": "thread_local", "pool": None} and steps._pool == "pool"
    assert runs == [4, 4, 4] and out.shape == (4, 3)  # two warm-up steps, then the recorded one


def _vocab_passes(fn, rows: int, vocab: int) -> int:
    """Operations that read or write a ``[rows, vocab]`` tensor while ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [x for x in (*args, *(kwargs or {}).values(), out) if isinstance(x, torch.Tensor)]
            Count.n += any(x.numel() == rows * vocab for x in tensors)
            return out

    with Count():
        fn()
    return Count.n


def test_a_sampled_token_and_its_logprob_share_one_pass_over_the_vocabulary():
    """The decoder's log-prob of a sampled token is read from the probabilities that sampled it: log softmax(logits / T)
    at the token, as before (to float32 rounding), with 7 operations over the vocabulary per token instead of 9
    (sampling, then scaling the logits again and taking their logsumexp)."""
    from sgrpo.model.head import log_softmax_at
    from sgrpo.rollout.sampling import sample_with_logprobs

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    tokens, logp, mass = sample_with_logprobs(logits, 0.7, 0, 1.0, greedy=False)
    assert mass.tolist() == [1.0] * 5  # nothing cut
    torch.manual_seed(1)
    assert torch.equal(tokens, sample(logits, 0.7, 0, 1.0, greedy=False)[0])
    torch.testing.assert_close(logp, log_softmax_at(logits / 0.7, tokens), atol=1e-6, rtol=0)
    greedy, greedy_logp, _ = sample_with_logprobs(logits, 0.7, 5, 0.9, greedy=True)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(greedy_logp, log_softmax_at(logits / 0.7, greedy), atol=0, rtol=0)
    passes = _vocab_passes(lambda: sample_with_logprobs(logits, 0.7, 0, 1.0, False), 5, 300)
    assert passes == 7  # measured on the code before: 9 (its sample, then log_softmax_at(logits / T, token))
