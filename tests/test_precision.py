"""Real-size concerns on the CPU: bf16 compute on fp32 master weights, fp16 with torch's GradScaler used the
ordinary way, a non-finite update skipped, the frozen reference, the static-cache rollout, and log-prob chunks
bounded in tokens."""
import json
import math
import warnings

import pytest
import torch

import dist_workers
from helpers import FAST, make_run, rollout_with_scores, spawn, step_on_batch, tg, tiny


def adam_step_bound(t, beta1=0.9, beta2=0.999):
    """Largest |m_hat_t| / sqrt(v_hat_t) over any gradients (Cauchy-Schwarz on Adam's bias-corrected averages):
    sqrt(sum_i a_i^2 / b_i), a_i = (1-b1) b1^(t-i) / (1-b1^t), b_i = (1-b2) b2^(t-i) / (1-b2^t)."""
    a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t) for i in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t) for i in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def run(tmp_path, dtype, steps, monkeypatch):
    """tg.main at lr 1e-6; returns the final weights, and the gradients each AdamW step received and the weights
    right after it."""
    grads, after = [], []
    real = torch.optim.AdamW.step

    def step(self, *a, **k):
        grads.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        out = real(self, *a, **k)
        after.append([p.detach().clone() for p in self.param_groups[0]["params"]])
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    res = tg.main(FAST + ["--max_steps", str(steps), "--dtype", dtype, "--learning_rate", "1e-6",
                          "--save_dir", str(tmp_path / dtype)])
    monkeypatch.undo()
    return list(res["model"].parameters()), grads, after


def test_bf16_updates_of_1e6_land_and_stay_within_adams_reach_of_fp32(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    start = list(tiny()[0].parameters())                 # the trainer's initial weights (same seed)
    bf16, grads, after = run(tmp_path, "bfloat16", 3, monkeypatch)
    # every weight whose gradient is non-zero moves in the first update (pure bf16 weights moved ~1% of them:
    # 1e-6 is below bf16's spacing near 0.02); they stay fp32 master weights
    for p0, p1, g in zip(start, after[0], grads[0]):
        assert p1.dtype == torch.float32
        assert torch.equal(p0 != p1, g != 0), "an update was lost"
    # 3 steps: each AdamW step moves a weight by at most lr * adam_step_bound(t), whatever the gradient,
    # so two runs from the same start differ by at most twice the sum
    fp32, _, _ = run(tmp_path, "float32", 3, monkeypatch)
    tol = 2 * 1e-6 * sum(adam_step_bound(t) for t in (1, 2, 3))
    for a, b, p0 in zip(bf16, fp32, start):
        assert a.dtype == torch.float32
        assert (a - b).abs().max().item() <= tol * (1 + 1e-3)
        assert not torch.equal(a, p0)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16" / "final")
    assert all(p.dtype == torch.float32 for p in final.parameters())  # plain from_pretrained loads it


@pytest.mark.parametrize("tied", [True, False])
def test_the_frozen_reference_computes_what_the_policy_computes_at_equal_weights(tied):
    """beta > 0 keeps a frozen copy whose Linear weights are stored in --dtype. Under bf16 autocast the policy's
    Linear layers get a bf16 copy of their fp32 weights, so at equal weights both give the same log-probs, bit for
    bit: the KL of step 1 is exactly 0. The embedding (and a head tied to it) and the norms stay fp32."""
    model, tok = tiny(seed=5)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.01)
    ref = tg.frozen_copy(model, torch.bfloat16)
    assert ref.get_input_embeddings().weight.dtype == torch.float32
    assert ref.model.norm.weight.dtype == torch.float32
    assert ref.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert ref.lm_head.weight.dtype == (torch.float32 if tied else torch.bfloat16)
    assert not any(p.requires_grad for p in ref.parameters())
    ids = torch.tensor([[3, 5, 7, 4, 9, 10, 6, 8], [0, 0, 4, 6, 3, 5, 9, 7]])
    am = (ids != 0).long()
    with torch.no_grad(), tg.autocast(tg.Args(dtype="bfloat16"), "cpu"):
        a = tg.completion_logps(model, ids, am, 4)[0]
        b = tg.completion_logps(ref, ids, am, 4)[0]
    assert torch.equal(a, b)                                                  # KL exactly 0 at step 1
    with torch.no_grad():                                                     # and bf16 did round something
        assert not torch.equal(a, tg.completion_logps(model, ids, am, 4)[0])


VARIED_PROMPTS = [p for p in ("abc=", "hgfedcba=", "ba=", "cabde=") for _ in range(2)]


def varied_prompts(tok):
    return tg.tokenize_prompts(tok, VARIED_PROMPTS, 64, "cpu")


def test_static_cache_greedy_tokens_equal_the_dynamic_caches():
    model, tok = tiny(seed=3)
    ids, am, _ = varied_prompts(tok)
    dynamic = tg.rollout(model, ids, am, tok, max_gen_len=6, do_sample=False)[0]
    static = tg.rollout(model, ids, am, tok, max_gen_len=6, do_sample=False, static_cache=True)[0]
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize("compiled", [False, True])
def test_static_cache_rollout_sees_the_weights_of_the_current_step(compiled, monkeypatch):
    import transformers
    from transformers import CompileConfig
    model, tok = tiny(seed=3)
    if compiled:  # transformers compiles the decode step on CUDA only; here force it, with dynamo's eager backend
        config = CompileConfig(backend="eager", fullgraph=False)
        config._compile_all_devices = True

        class Compiled(transformers.GenerationConfig):   # rollout's config, with this compile_config
            def __init__(self, **kw):
                super().__init__(**kw)
                if kw.get("cache_implementation") == "static":
                    self.compile_config = config
        monkeypatch.setattr(transformers, "GenerationConfig", Compiled)
    import torch._dynamo.utils as dynamo_utils
    graphs = [dynamo_utils.counters["stats"]["unique_graphs"]]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):   # rollout, update, rollout: the second must sample from the updated weights
        input_ids, attn, comp, mask, scores = rollout_with_scores(model, tok, VARIED_PROMPTS, seed=step,
                                                                  static_cache=True)
        logps, _, _ = tg.completion_logps(model, input_ids, attn, comp.shape[1])
        sampler = torch.log_softmax(scores.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
        m = mask.bool()
        torch.testing.assert_close(logps[m], sampler[m], rtol=0, atol=1e-5)
        (-logps[m].sum()).backward()
        opt.step()
        opt.zero_grad()
        graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
    if compiled:  # compiled once, and the updated weights did not make it compile again
        assert graphs[1] > graphs[0] and graphs[2] == graphs[1], graphs
    else:
        assert graphs[2] == graphs[0]


def test_largest_logits_chunk_does_not_grow_with_rows():
    model, tok = tiny()
    biggest = []
    real = tg.lm_logits

    def recording(m, hidden):
        z = real(m, hidden)
        biggest.append(z.numel())
        return z
    tg.lm_logits = recording
    try:
        for rows in (2, 8, 32):
            ids = torch.randint(3, len(tok), (rows, 12))
            biggest.clear()
            logps, _, _ = tg.completion_logps(model, ids, torch.ones_like(ids), 8, chunk_size=16)
            logps.sum().backward()                        # the chunks are recomputed in backward: same size
            assert max(biggest) <= 16 * len(tok), (rows, max(biggest))
            assert len(biggest) == 2 * math.ceil(rows * 8 / 16)
    finally:
        tg.lm_logits = real


@pytest.fixture(scope="module")
def fp16_overflow(tmp_path_factory):
    """Rewards x1000 and no std division: the gradients overflow fp16 at the starting scale 2^16."""
    save_dir = tmp_path_factory.mktemp("fp16_overflow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tg.main(FAST + ["--dtype", "float16", "--scale_rewards", "none", "--reward_weights", "1000",
                        "--max_steps", "11", "--warmup_steps", "4", "--save_dir", str(save_dir)])
    rows = [json.loads(l) for l in open(save_dir / "metrics.jsonl")]
    return rows, [str(w.message) for w in caught]


def test_fp16_overflow_halves_the_scale_skips_the_update_and_the_run_continues(fp16_overflow):
    """Each overflow halves the scale and skips the update (counted) until the scale fits; then every step
    updates, to the end of the run."""
    rows, _ = fp16_overflow
    assert [r["step"] for r in rows] == list(range(1, 12))
    n = rows[-1]["skipped_updates"]
    assert 3 <= n <= 8                                               # measured: 7 (the scale fits at 2^9)
    assert [r["skipped_updates"] for r in rows] == list(range(1, n + 1)) + [n] * (11 - n)
    assert [r["loss_scale"] for r in rows[:n]] == [2.0 ** (16 - k) for k in range(1, n + 1)]
    assert all(r["grad_norm"] is None for r in rows[:n])           # not finite: null in the JSON log
    assert all(math.isfinite(r["grad_norm"]) and r["loss_scale"] == 2.0 ** (16 - n) for r in rows[n:])


def test_fp16_overflow_skips_leave_the_schedule_waiting(fp16_overflow):
    """A skipped update does not advance the schedule (HF Trainer's rule): the warm-up starts at its first rate
    once the scale fits, and torch never warns of a scheduler step without an optimizer step."""
    rows, caught = fp16_overflow
    n = rows[-1]["skipped_updates"]
    assert not [w for w in caught if "lr_scheduler.step()" in w]     # torch's warning of a step without update
    # the k-th applied update (from 0) uses lr (k + 1) / (warmup + 1); skipped steps show the rate waiting
    factors = [1 / 5] * n + [min(k + 1, 5) / 5 for k in range(11 - n)]
    assert [r["learning_rate"] for r in rows] == pytest.approx([2e-4 * f for f in factors], rel=1e-9)


def test_sft_warmup_under_fp16_scales_its_loss_like_the_grpo_update():
    """The gradient backward hands a weight is the true gradient times the loss scale (2^16) under fp16,
    and the true gradient in fp32: the warm-up's fp16 gradients do not flush to zero."""
    seen = {}
    for dtype in ("float32", "float16"):
        model, tok = tiny()
        args = tg.parse_args(["--dtype", dtype, "--sft_warmup_steps", "1", "--batch_size", "8"])
        w = model.get_input_embeddings().weight                       # tied: the lm_head's matmul too
        w.register_hook(lambda g, dtype=dtype: seen.setdefault(dtype, g.detach().clone()))
        tg.sft_warmup(model, tok, tg.make_reverse_task(16)[0], args, torch.device("cpu"), 0, 1)
    ratio = (seen["float16"].norm() / seen["float32"].norm()).item()
    assert ratio == pytest.approx(2.0 ** 16, rel=0.05)


def test_a_non_finite_grad_norm_under_fp32_skips_the_update_and_counts_it(monkeypatch):
    """fp32 has no GradScaler to skip for it: a NaN loss (so a NaN grad norm) leaves the weights and AdamW's
    state as they were, is counted in skipped_updates, and leaves no gradient behind; the next step updates."""
    model, tok = tiny()
    args = tg.parse_args(["--batch_size", "2", "--num_generations", "4", "--max_gen_len", "6"])
    optimizer, scheduler = tg.build_optimizer(model, args)

    def varied(completions, **kwargs):                                # rewards that differ in each group
        return [float(i % 3) for i in range(len(completions))]
    trainer = make_run(model, tok, optimizer, reward_fns=[varied], weights=[1.0], scheduler=scheduler)
    real, calls = tg.policy_objective, []

    def nan_first(*a, **k):
        loss, stats = real(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 1 else loss), stats
    monkeypatch.setattr(tg, "policy_objective", nan_first)
    rows, state = tg.make_reverse_task(16)[0][:2], tg.TrainState()
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    first, _ = tg.grpo_step(args, trainer, rows, state)
    assert len(calls) == 1 and math.isnan(first["grad_norm"])
    assert first["skipped_updates"] == state.skipped_updates == 1
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    second, _ = tg.grpo_step(args, trainer, rows, state)
    assert math.isfinite(second["grad_norm"]) and second["grad_norm"] > 0
    assert second["skipped_updates"] == state.skipped_updates == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def fp16_grads(model, tok, dtype, fp16):
    """dapo's gradient of one micro-batch of 160 rows x 128 masked tokens (20,480), as the optimizer sees it."""
    torch.manual_seed(0)
    rows, T = 160, 128
    ids = torch.randint(3, len(tok), (rows, 8 + T))
    mask = torch.ones(rows, T)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mask=mask, advantages=torch.randn(rows))
    args = tg.parse_args(["--loss_type", "dapo", "--dtype", dtype, "--batch_size", "20", "--grad_clip", "0"])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0), fp16=fp16)
    _, received = step_on_batch(args, run, batch)                   # the step unscales before the optimizer
    return torch.cat([g.flatten() for g in received[0] if g is not None])


def test_fp16_with_loss_scaling_keeps_the_gradient_that_fp32_computes():
    model, tok = tiny()
    g32 = fp16_grads(model, tok, "float32", fp16=False)
    scaled = fp16_grads(model, tok, "float16", fp16=True)
    unscaled = fp16_grads(model, tok, "float16", fp16=False)         # no loss scaling
    err = lambda g: ((g - g32).norm() / g32.norm()).item()
    assert err(scaled) < 0.01 < err(unscaled)                         # measured: 6e-4 vs 0.076


def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale(tmp_path):
    spawn(dist_workers.fp16_skip, str(tmp_path), "ddp")
    ranks = [torch.load(tmp_path / f"fp16_ddp_{r}.pt", weights_only=True) for r in (0, 1)]
    for r in ranks:
        assert r["moved_after_inf"] is False and r["scale_after_inf"] == 2.0 ** 15   # skipped, halved
        assert r["moved_after_good"] is True and r["scale_after_good"] == 2.0 ** 15  # then steps again
        assert r["skipped_updates"] == [1, 1]                                         # the skip is counted
    for k in ranks[0]["params"]:
        assert torch.equal(ranks[0]["params"][k], ranks[1]["params"][k])


def test_fp16_resume_restores_the_loss_scale(tmp_path, monkeypatch):
    """Step 1's gradient gets an inf (the scale halves to 2^15); a run resumed at step 1 must keep 2^15."""
    real = torch.amp.GradScaler.unscale_
    calls = []

    def plant_inf_once(scaler, optimizer):  # after backward, before the step unscales
        calls.append(1)
        if len(calls) == 1:
            next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None).grad.view(-1)[0] = \
                torch.inf
        return real(scaler, optimizer)
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", plant_inf_once)
    base = FAST + ["--dtype", "float16", "--max_steps", "3"]
    tg.main(base + ["--save_dir", str(tmp_path / "straight")])
    calls.clear()
    tg.main(base + ["--save_dir", str(tmp_path / "cut"), "--stop_after", "1"])
    calls.append(1)                                              # the resumed process plants nothing
    tg.main(base + ["--save_dir", str(tmp_path / "cut"), "--resume", "auto"])
    straight, cut = ([json.loads(l) for l in open(tmp_path / d / "metrics.jsonl")] for d in ("straight", "cut"))
    assert [r["loss_scale"] for r in straight] == [2.0 ** 15] * 3
    assert [r["loss_scale"] for r in cut] == [r["loss_scale"] for r in straight]
    assert [r["skipped_updates"] for r in straight] == [1, 1, 1]
    assert [r["skipped_updates"] for r in cut] == [1, 1, 1]
    assert [r["reward"] for r in cut] == [r["reward"] for r in straight]
