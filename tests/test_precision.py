"""Real-size concerns on the CPU: bf16 compute on fp32 master weights, the static-cache rollout, and log-prob
chunks bounded in tokens."""
import json
import math

import pytest
import torch

from helpers import FAST, run_cli, tg, tiny


def adam_step_bound(t, beta1=0.9, beta2=0.999):
    """Largest |m_hat_t| / sqrt(v_hat_t) over any gradients (Cauchy-Schwarz on Adam's bias-corrected averages):
    sqrt(sum_i a_i^2 / b_i), a_i = (1-b1) b1^(t-i) / (1-b1^t), b_i = (1-b2) b2^(t-i) / (1-b2^t)."""
    a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t) for i in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t) for i in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def run(tmp_path, dtype, steps, monkeypatch):
    grads = []
    real = torch.optim.AdamW.step

    def step(self, *a, **k):
        grads.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        return real(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    res = tg.main(FAST + ["--max_steps", str(steps), "--dtype", dtype, "--learning_rate", "1e-6",
                          "--save_dir", str(tmp_path / dtype)])
    monkeypatch.undo()
    return list(res["model"].parameters()), grads


def test_bf16_updates_of_1e6_land_and_stay_within_adams_reach_of_fp32(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    start = list(tiny()[0].parameters())                 # the trainer's initial weights (same seed)
    after, grads = run(tmp_path, "bfloat16", 1, monkeypatch)
    # every weight whose gradient is non-zero moves (pure bf16 weights moved ~1% of them: 1e-6 is below
    # bf16's spacing near 0.02); they stay fp32 master weights
    for p0, p1, g in zip(start, after, grads[0]):
        assert p1.dtype == torch.float32
        assert torch.equal(p0 != p1, g != 0), "an update was lost"
    # 3 steps: each AdamW step moves a weight by at most lr * adam_step_bound(t), whatever the gradient,
    # so two runs from the same start differ by at most twice the sum
    bf16, _ = run(tmp_path / "3", "bfloat16", 3, monkeypatch)
    fp32, _ = run(tmp_path / "3", "float32", 3, monkeypatch)
    tol = 2 * 1e-6 * sum(adam_step_bound(t) for t in (1, 2, 3))
    for a, b, p0 in zip(bf16, fp32, start):
        assert (a - b).abs().max().item() <= tol * (1 + 1e-3)
        assert not torch.equal(a, p0)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "3" / "bfloat16" / "final")
    assert all(p.dtype == torch.float32 for p in final.parameters())  # plain from_pretrained loads it


def varied_prompts(tok):
    return tg.tokenize_prompts(tok, [p for p in ("abc=", "hgfedcba=", "ba=", "cabde=") for _ in range(2)], 64, "cpu")


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
    ids, am, _ = varied_prompts(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):   # rollout, update, rollout: the second must sample from the updated weights
        scores, real = {}, model.generate

        def generate(**kw):
            kw["generation_config"].output_scores = kw["generation_config"].return_dict_in_generate = True
            out = real(**kw)
            scores["s"] = torch.stack(out.scores, 1)
            return out.sequences
        model.generate = generate
        torch.manual_seed(step)
        comp, mask, *_ = tg.rollout(model, ids, am, tok, max_gen_len=6, static_cache=True)
        del model.generate
        logps, _, _ = tg.completion_logps(model, torch.cat([ids, comp], 1), torch.cat([am, mask], 1), comp.shape[1])
        sampler = torch.log_softmax(scores["s"].float(), -1).gather(-1, comp[..., None]).squeeze(-1)
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


def test_fp16_overflow_skips_wait_for_the_scale_and_leave_the_schedule(tmp_path):
    """Rewards x1000 and no std division: the gradients overflow fp16 at the starting scale 2^16. Each
    overflow halves the scale and skips the update (counted, never a step toward the stop) until the scale
    fits; the warm-up then starts at its first rate: a skipped step does not advance the schedule."""
    res = run_cli(*FAST, "--dtype", "float16", "--scale_rewards", "none", "--reward_weights", "1000",
                  "--max_steps", "11", "--warmup_steps", "4", "--save_dir", tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "lr_scheduler.step()" not in res.stderr                  # torch's warning of a step without update
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    n = rows[-1]["skipped_steps"]
    assert 3 <= n <= 8                                               # measured: 7 (the scale fits at 2^9)
    assert [r["skipped_steps"] for r in rows] == list(range(1, n + 1)) + [n] * (11 - n)
    assert [r["loss_scale"] for r in rows[:n]] == [2.0 ** (16 - k) for k in range(1, n + 1)]
    assert all(r["skipped_steps_in_a_row"] == 0 for r in rows)
    # the k-th applied update (from 0) uses lr (k + 1) / (warmup + 1); skipped steps show the rate waiting
    factors = [1 / 5] * n + [min(k + 1, 5) / 5 for k in range(11 - n)]
    assert [r["lr"] for r in rows] == pytest.approx([2e-4 * f for f in factors], rel=1e-9)


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


@pytest.mark.parametrize("fp16, scale, loss, inf_grad, counts, scale_after", [
    (True, 2.0 ** 16, 1.0, True, 0, 2.0 ** 15),      # an overflow the scale can cure: skipped, not counted
    (True, 2.0, 1.0, True, 0, 1.0),
    (True, 1.0, 1.0, True, 1, 1.0),                  # at the smallest scale: the gradient's own overflow
    (True, 2.0 ** 16, float("nan"), False, 1, 2.0 ** 15),  # a loss no scale cures
    (False, None, 1.0, True, 1, None),               # fp32/bf16: every skip counts
])
def test_a_skip_counts_toward_the_stop_when_the_loss_scale_cannot_cure_it(fp16, scale, loss, inf_grad, counts,
                                                                          scale_after):
    from helpers import make_run
    model, tok = tiny()
    run = make_run(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3), fp16=fp16)
    if fp16:
        run.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        run.scaler.scale(torch.ones(()))                               # the scaler's first use sets its scale
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if inf_grad:
        next(model.parameters()).grad.view(-1)[0] = torch.inf
    state = tg.TrainState()                         # bad_in_a_row 0: the step sets it so as it starts
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)     # as step 13 computes it
    assert tg.update_is_finite(run.scaler, state, loss, grad_norm, "cpu", 1) is False  # skipped; 1 before
    assert state.skipped_steps == 1 and state.bad_in_a_row == (2 if counts else 0)
    if fp16:
        assert run.scaler.get_scale() == scale_after


def test_a_warm_up_that_cannot_step_stops_in_one_line():
    model, tok = tiny()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    args = tg.parse_args(["--sft_warmup_steps", "6", "--batch_size", "4"])
    with pytest.raises(tg.TrainerError, match="supervised warm-up: loss or grad norm not finite for 3 steps"):
        tg.sft_warmup(model, tok, tg.make_reverse_task(16)[0], args, torch.device("cpu"), 0, 1)


def test_the_stop_counts_failing_steps_not_the_updates_of_one_step(tmp_path, monkeypatch):
    """mu = 3 updates per step, one micro-batch each (one grpo_loss call per update; no row skipped). A step
    fails once, whichever and however many of its updates had a non-finite loss; a step without one ends the
    run of failures; the third failing step in a row stops the run."""
    bad = {(1, 1), (2, 0), (4, 0), (4, 1), (4, 2), (5, 2), (6, 0)}           # (step, update): a NaN loss
    calls, real = [0], tg.grpo_loss

    def nan_loss(*a, **k):
        step, update = divmod(calls[0], 3)
        calls[0] += 1
        loss, stats = real(*a, **k)
        return (loss * float("nan") if (step + 1, update) in bad else loss), stats
    monkeypatch.setattr(tg, "grpo_loss", nan_loss)
    with pytest.raises(tg.TrainerError, match=r"^step 6: loss not finite, .* for 3 steps in a row"):
        tg.main(FAST + ["--num_iterations", "3", "--skip_zero_advantage_rows", "0", "--max_steps", "8",
                        "--save_dir", str(tmp_path)])
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]         # steps 1-5: step 6 stopped
    assert [r["skipped_steps_in_a_row"] for r in rows] == [1, 2, 0, 1, 2]
    assert [r["skipped_steps"] for r in rows] == [1, 2, 2, 5, 6]              # updates skipped, in all
