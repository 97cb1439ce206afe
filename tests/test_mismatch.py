"""The sampler against the trainer: the sampler's own log-probs, the five mismatch metrics (logged, never a
weight on the loss), scoring under the sampler's truncation, and fp16 with dynamic loss scaling. Every expected
value is computed here from a plain full forward of the model (model(...).logits) and transformers' own
top-k/top-p warpers, not from the trainer's functions."""
import json

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

import dist_workers
from helpers import FAST, make_run, spawn, tg, tiny, step_on_batch
from test_flag_table import one_step


def plain_logits(model, input_ids, attention_mask, T, temperature):
    """[rows, T, V] logits predicting the last T tokens, from one ordinary forward (the test's own reference)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return z[:, -T - 1:-1].float() / temperature


def hf_kept(z, top_k=0, top_p=1.0):
    """The kept set of transformers' TopK then TopP warpers (what generate uses), as a bool mask."""
    flat = z.reshape(-1, z.shape[-1])
    if top_k:
        flat = TopKLogitsWarper(top_k)(None, flat)
    if top_p < 1:
        flat = TopPLogitsWarper(top_p)(None, flat)
    return torch.isfinite(flat).view(z.shape)


def starting_model(args):
    """The model one_step starts from (its seed, the trainer's loader)."""
    torch.manual_seed(0)
    return tg.load_model_and_tokenizer(args, torch.device("cpu"))[0]


def captured_step(monkeypatch, **flags):
    """one_step (the trainer's built-in model, 2 prompts x 4) with the rollout's outputs captured. Every row
    is trained (the mismatch metrics cover the rows trained on; here the tests compare them with all rows)."""
    seen, real = [], tg.rollout
    monkeypatch.setattr(tg, "rollout", lambda *a, **k: seen.append((a, real(*a, **k))) or seen[-1][1])
    run = one_step(**{"skip_zero_advantage_rows": 0, **flags})
    (policy, prompt_ids, prompt_mask, *_), (comp, mask, _, sampler_logps) = seen[0]
    return run, prompt_ids, prompt_mask, comp, mask, sampler_logps


def test_truncation_keeps_what_transformers_keeps():
    torch.manual_seed(0)
    z = torch.randn(64, 50)
    z[:, 7] = z[:, 3]                                              # ties at the k-th value stay, as in HF
    for top_k, top_p in ((5, 1.0), (0, 0.7), (10, 0.5), (1, 0.9), (0, 0.01)):
        ours = torch.isfinite(tg.top_k_top_p_filter(z, top_k, top_p))
        assert torch.equal(ours, hf_kept(z, top_k, top_p)), (top_k, top_p)
    keep = torch.randint(0, 50, (64,))                             # the sampled token is always kept
    ours = torch.isfinite(tg.top_k_top_p_filter(z, 0, 0.3, keep=keep))
    assert ours.gather(1, keep[:, None]).all()
    assert torch.equal(ours, hf_kept(z, 0, 0.3).scatter(1, keep[:, None], True))


def test_fp32_full_distribution_sampler_and_trainer_agree(monkeypatch):
    run, prompt_ids, prompt_mask, comp, mask, sampler_logps = captured_step(monkeypatch, temperature=0.7)
    r = run.record
    assert r["sampler_logp_diff_max"] <= 1e-5 and r["sampler_logp_diff_mean"] <= r["sampler_logp_diff_max"]
    assert r["is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 1 - 1e-5 <= r["is_ratio_min"] <= r["is_ratio_mean"] <= r["is_ratio_max"] <= 1 + 1e-5
    # the sampler's log-prob is log softmax(z / 0.7)[o] of the policy that sampled (weights before the update)
    model = starting_model(run.args)
    with torch.no_grad():
        z = plain_logits(model, torch.cat([prompt_ids, comp], 1), torch.cat([prompt_mask, mask], 1),
                         comp.shape[1], 0.7)
    want = torch.log_softmax(z, -1).gather(-1, comp[..., None]).squeeze(-1) * mask
    torch.testing.assert_close(sampler_logps, want, rtol=0, atol=1e-5)
    assert mask.sum() > 10 and (sampler_logps[mask.bool()] < 0).all()


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (3, 1.0)])
def test_replay_scores_the_truncated_distribution_and_its_gradient(monkeypatch, top_k, top_p):
    run, prompt_ids, prompt_mask, comp, mask, _ = captured_step(monkeypatch, top_p=top_p, top_k=top_k)
    r = run.record
    assert 1 - 1e-5 <= r["is_ratio_min"] <= r["is_ratio_max"] <= 1 + 1e-5 and r["sampler_logp_diff_max"] <= 1e-5
    # the gradient of sum_t w_t logp_t equals the hand-made one: logp = z[o] - logsumexp(z over the kept set)
    model = starting_model(run.args)
    ids, am, T = torch.cat([prompt_ids, comp], 1), torch.cat([prompt_mask, mask], 1), comp.shape[1]
    w = torch.randn(comp.shape) * mask
    logps, _, _ = tg.completion_logps(model, ids, am, T, top_k=top_k, top_p=top_p, chunk_size=5)
    ours = torch.autograd.grad((w * logps).sum(), list(model.parameters()), allow_unused=True)
    z = plain_logits(model, ids, am, T, 1.0)
    kept = hf_kept(z.detach(), top_k, top_p).scatter(-1, comp[..., None], True)
    hand = z.gather(-1, comp[..., None]).squeeze(-1) - torch.logsumexp(z.masked_fill(~kept, -torch.inf), -1)
    torch.testing.assert_close(logps, hand, rtol=0, atol=1e-5)
    theirs = torch.autograd.grad((w * hand).sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(ours, theirs):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert (kept.sum(-1) < z.shape[-1]).all()                                   # something was truncated


def test_a_planted_mismatch_is_logged_and_leaves_the_gradient_alone():
    """A planted mismatch: the sampler's log-probs are the trainer's shifted by known amounts. One
    grpo_step of the tiny model on that batch: its five metrics by hand, and the gradient of the plain
    REINFORCE sum (the mismatch is measured, never a weight)."""
    model, tok = tiny()
    torch.manual_seed(0)
    rows, P, T = 4, 5, 6
    ids = torch.randint(3, len(tok), (rows, P + T))
    mask = torch.ones(rows, T)
    mask[1, 4:] = mask[3, 2:] = 0
    shift = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 2.0]).repeat(rows, 1)      # log rho = old - sampler
    A = torch.tensor([1.0, -0.5, 2.0, -1.5])
    with torch.no_grad():
        old = tg.completion_logps(model, ids, torch.ones_like(ids), T)[0]
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mask=mask, advantages=A,
                 sampler_logps=(old - shift) * mask)
    args = tg.parse_args(["--batch_size", "2", "--num_generations", "2", "--grad_clip", "0"])
    names = [n for n, p in model.named_parameters()]
    record, received = step_on_batch(args, make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0)), batch)
    ours = dict(zip(names, received[0]))
    rho = shift.exp()
    # grpo loss, on-policy (ratio 1, gradient dlogp): L = mean_i sum_t -A_i m_t logp_t / sum_t m_t
    logps = tg.completion_logps(model, ids, torch.ones_like(ids), T)[0]
    hand = (-(A[:, None] * mask * logps).sum(1) / mask.sum(1)).mean()
    hand.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[n], p.grad, rtol=1e-5, atol=1e-8)
    on = mask.bool()
    logged = record                                                  # the step's record
    assert logged["is_ratio_max"] == pytest.approx(rho[on].max().item(), rel=1e-5)
    assert logged["is_ratio_min"] == pytest.approx(rho[on].min().item(), rel=1e-5)
    assert logged["is_ratio_mean"] == pytest.approx(rho[on].mean().item(), rel=1e-5)
    assert logged["sampler_logp_diff_mean"] == pytest.approx(shift.abs()[on].mean().item(), rel=1e-5)
    assert logged["sampler_logp_diff_max"] == pytest.approx(shift.abs()[on].max().item(), rel=1e-5)


def fp16_grads(model, tok, dtype, fp16):
    """dapo's gradient of one micro-batch of 160 rows x 128 masked tokens (20,480), as the optimizer sees it."""
    torch.manual_seed(0)
    rows, T = 160, 128
    ids = torch.randint(3, len(tok), (rows, 8 + T))
    mask = torch.ones(rows, T)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mask=mask, advantages=torch.randn(rows),
                 sampler_logps=torch.zeros(rows, T))
    args = tg.parse_args(["--loss_type", "dapo", "--dtype", dtype, "--batch_size", "20", "--grad_clip", "0"])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0), fp16=fp16)
    _, received = step_on_batch(args, run, batch)                   # the step unscales before the optimizer
    return torch.cat([g.flatten() for g in received[0] if g is not None])


def test_fp16_with_loss_scaling_keeps_the_gradient_that_fp32_computes():
    model, tok = tiny()
    g32 = fp16_grads(model, tok, "float32", fp16=False)
    scaled = fp16_grads(model, tok, "float16", fp16=True)
    unscaled = fp16_grads(model, tok, "float16", fp16=False)         # the old behaviour: no loss scaling
    err = lambda g: ((g - g32).norm() / g32.norm()).item()
    assert err(scaled) < 0.01 < err(unscaled)                         # measured: 6e-4 vs 0.076


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale(tmp_path, mode):
    spawn(dist_workers.fp16_skip, str(tmp_path), mode)
    ranks = [torch.load(tmp_path / f"fp16_{mode}_{r}.pt", weights_only=True) for r in (0, 1)]
    for r in ranks:
        assert r["moved_after_inf"] is False and r["scale_after_inf"] == 2.0 ** 15   # skipped, halved
        assert r["moved_after_good"] is True and r["scale_after_good"] == 2.0 ** 15  # then steps again
        # an overflow the scale can still cure is skipped and counted, never a step toward the stop
        assert r["skipped_steps"] == [1, 1] and r["bad_in_a_row"] == [0, 0]
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
    assert [r["skipped_steps"] for r in straight] == [1, 1, 1] and straight[0]["skipped_steps_in_a_row"] == 0
    assert [r["reward"] for r in cut] == [r["reward"] for r in straight]
