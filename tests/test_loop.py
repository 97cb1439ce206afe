"""The loop's wiring, pinned by values: what grpo_step logs and computes, each against an independent
computation (a plain full-logits forward, the schedule by hand, the combined batch in one process)."""
import json

import pytest
import torch

from helpers import FAST, dist_suite, run_cli, tg, tiny


def logged(tmp_path, *flags, monkeypatch=None, capture=None):
    """Run the real loop in this process; capture=list records each rollout (completion ids, mask, truncated)."""
    if capture is not None:
        real = tg.rollout
        monkeypatch.setattr(tg, "rollout", lambda *a, **k: capture.append((a, real(*a, **k))) or capture[-1][1])
    tg.main(FAST + list(flags) + ["--save_dir", str(tmp_path)])
    return [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]


def full_forward(model, prompt_ids, prompt_mask, comp, mask):
    """Plain forward over prompt + completion: logits [rows, T, V] at the completion positions."""
    ids, attn = torch.cat([prompt_ids, comp], 1), torch.cat([prompt_mask, mask], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return model(ids, attention_mask=attn, position_ids=pos).logits[:, -comp.shape[1] - 1:-1].double()


def test_logged_entropy_is_that_of_the_sampling_distribution(tmp_path, monkeypatch):
    rollouts = []
    rows = logged(tmp_path, "--max_steps", "1", "--temperature", "0.7", monkeypatch=monkeypatch, capture=rollouts)
    (args, (comp, mask, *_)), = rollouts
    model, tok = tiny()                                 # the trainer's initial weights (same seed, same config)
    with torch.no_grad():
        logp = torch.log_softmax(full_forward(model, args[1], args[2], comp, mask) / 0.7, -1)
    entropy = -(logp.exp() * logp).sum(-1)                                        # [rows, T] at temperature 0.7
    want = (entropy * mask).sum() / mask.sum()                                    # every row's tokens
    assert rows[0]["entropy"] == pytest.approx(want.item(), rel=1e-5)


def test_kl_is_zero_at_step_1_then_positive_against_a_frozen_reference(tmp_path):
    rows = logged(tmp_path, "--max_steps", "3", "--beta", "0.04", "--learning_rate", "1e-3")
    kl = [r["kl"] for r in rows]
    assert kl[0] == 0.0                   # the reference is the policy before the first update
    assert kl[1] > 1e-6 and kl[2] > 1e-6  # the policy moved, the reference did not


def test_reference_and_old_log_probs_run_one_micro_batch_at_a_time(tmp_path, monkeypatch):
    """--micro_batch_size 4 --beta 0.04 --num_iterations 2 on B*G = 16 rows: no log-prob pass, the no-grad
    reference and old ones included, holds more than a micro-batch, and the reference and old log-probs the loss
    receives equal one full-batch forward of the policy that sampled (an independent computation)."""
    calls, losses, rollouts = [], [], []
    real_logps, real_loss = tg.completion_logps, tg.policy_objective

    def completion_logps(model, input_ids, *a, **k):
        calls.append((input_ids.shape[0], torch.is_grad_enabled()))
        return real_logps(model, input_ids, *a, **k)

    def policy_objective(logps, old, adv, mask, **k):
        losses.append((old, k["ref_logps"]))
        return real_loss(logps, old, adv, mask, **k)
    monkeypatch.setattr(tg, "completion_logps", completion_logps)
    monkeypatch.setattr(tg, "policy_objective", policy_objective)
    logged(tmp_path, "--max_steps", "1", "--micro_batch_size", "4", "--beta", "0.04", "--num_iterations", "2",
           monkeypatch=monkeypatch, capture=rollouts)
    (args, (comp, mask, *_)), = rollouts
    assert comp.shape[0] == 16 and max(n for n, _ in calls) <= 4
    assert [n for n, grad in calls if not grad] == [4] * 8        # the reference, then old: 4 micro-batches each
    assert [n for n, grad in calls if grad] == [4] * 8            # 2 updates of 4 micro-batches
    model, tok = tiny()                                 # the trainer's initial weights (same seed, same config)
    with torch.no_grad():
        logp = torch.log_softmax(full_forward(model, args[1], args[2], comp, mask), -1)
    want = logp.gather(-1, comp[..., None]).squeeze(-1)[mask.bool()]
    for update in (losses[:4], losses[4:]):                       # both updates get the same old and reference
        old, ref = torch.cat([o for o, _ in update]), torch.cat([r for _, r in update])
        torch.testing.assert_close(old[mask.bool()].double(), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ref[mask.bool()].double(), want, rtol=0, atol=1e-5)


def test_above_the_target_the_coefficient_falls_and_the_bonus_is_off(tmp_path):
    # target 0: every entropy is above it. The coefficient starts at 0.003 and falls by delta per step; no
    # step applies a bonus (step 1: no entropy measured yet; then each is above the target)
    rows = logged(tmp_path, "--max_steps", "4", "--loss_type", "bnpo", "--use_adaptive_entropy", "1",
                  "--entropy_coef", "0.003", "--entropy_target", "0", "--entropy_coef_delta", "0.001")
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.002, 0.001, 0.0, 0.0], abs=1e-12)
    assert [r["entropy_coef_applied"] for r in rows] == [0.0] * 4
    assert all(r["loss"] == pytest.approx(r["policy_loss"], rel=1e-6, abs=1e-9) for r in rows)


def test_moe_loss_is_policy_loss_plus_the_configs_coefficient_times_aux(tmp_path):
    coef = tiny(use_moe=1)[0].config.router_aux_loss_coef
    assert coef not in (0.0, 1.0)
    rows = logged(tmp_path, "--max_steps", "2", "--use_moe", "1", "--micro_batch_size", "8")
    for r in rows:
        assert r["aux_loss"] > 0
        assert r["loss"] == pytest.approx(r["policy_loss"] + coef * r["aux_loss"], rel=1e-5, abs=1e-8)


def test_loop_keeps_entropy_out_of_the_graph_when_no_bonus_applies(monkeypatch):
    # inside the loop the entropy must carry a graph only when a bonus uses it: one that does holds a
    # softmax-sized graph through backward (the chunk recomputes it there), for a number that is only logged
    from helpers import make_run, sample_batch, step_on_batch
    model, tok = tiny()
    input_ids, attn, comp, mask = sample_batch(model, tok)
    args = tg.parse_args(["--batch_size", "4", "--num_generations", "4", "--micro_batch_size", "8"])
    batch = dict(input_ids=input_ids, attention_mask=attn, mask=mask, advantages=torch.randn(16))
    seen, real = [], tg.completion_logps
    monkeypatch.setattr(tg, "completion_logps", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    for coef in (0.0, 0.01):
        seen.clear()
        run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
        record, _ = step_on_batch(args, run, batch, tg.TrainState(entropy_coef_applied=coef))
        assert len(seen) == 2 and all(entropy.requires_grad == (coef != 0.0) for _, entropy, _ in seen)
        # the logged entropy is the same number either way
        want = sum((e.detach() * mask[8 * i:8 * i + 8]).sum().item() for i, (_, e, _) in enumerate(seen))
        assert record["entropy"] == pytest.approx(want / mask.sum().item())


def test_left_truncation_keeps_the_end_of_the_prompt():
    tok = tg.build_char_tokenizer(tg.REVERSE_ALPHABET + "=")
    ids, am, n_cut = tg.tokenize_prompts(tok, ["abcdefg=", "ab="], 4, "cpu")
    assert n_cut == 1
    assert [tok.decode(i[m.bool()]) for i, m in zip(ids, am)] == ["efg=", "ab="]
    assert am.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]  # left-padded


def test_two_ranks_with_micro_steps_equal_one_process_on_the_combined_batch():
    import statistics
    ranks = [torch.load(dist_suite() / f"loop_{r}.pt", weights_only=True) for r in (0, 1)]
    tok = tg.build_char_tokenizer(tg.REVERSE_ALPHABET + "=")
    model, _ = tiny()
    for case in ("dapo", "cispo", "grpo", "grpo, groups split"):
        loss_type = case.split(",")[0]
        parts = [r[case] for r in ranks]
        N = sum(p["mask"].sum().item() for p in parts)                           # tokens of both ranks
        R = sum(p["mask"].shape[0] for p in parts)
        # on-policy, every loss type's gradient is that of -A logp (ratio 1, inside the clip; cispo's weight 1),
        # normalized over the combined batch: dapo/cispo by all N tokens, grpo per sequence over all R rows
        model.zero_grad(set_to_none=True)
        total = 0.0
        for p in parts:
            texts = [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(p["comp"], p["mask"])]
            rewards = [sum(a == b for a, b in zip(t, ans)) / max(len(t), len(ans), 1)   # the reward, by hand
                       for t, ans in zip(texts, p["answers"])]
            adv = []
            for g in range(0, len(rewards), 4):                                   # groups of G = 4
                grp = rewards[g:g + 4]
                adv += [(x - statistics.mean(grp)) / (statistics.stdev(grp) + 1e-4) for x in grp]
            z = full_forward(model, p["prompt_ids"], p["prompt_mask"], p["comp"], p["mask"])
            logp = torch.log_softmax(z, -1).gather(-1, p["comp"][..., None]).squeeze(-1)
            per_token = -torch.tensor(adv, dtype=torch.float64)[:, None] * logp * p["mask"]
            if loss_type == "grpo":
                total = total + (per_token.sum(1) / p["mask"].sum(1).clamp(min=1)).sum() / R
            else:
                total = total + per_token.sum() / N
        total.backward()
        for name, param in model.named_parameters():
            for p in parts:
                torch.testing.assert_close(p["grads"][name], param.grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{case} {name}: {m}")


def test_two_ranks_warm_up_on_an_uneven_split_takes_the_mean_over_the_whole_batch():
    # dist_workers.warm_up_grads: one warm-up step of --sft_batch_size 3 on 2 ranks, the gradient the clip saw
    ranks = [torch.load(dist_suite() / f"warm_{r}.pt", weights_only=True) for r in (0, 1)]
    assert [len(r["prompts"]) for r in ranks] == [2, 1]                       # 3 rows: 2 and 1
    model, tok = tiny()
    prompts = ranks[0]["prompts"] + ranks[1]["prompts"]
    ids, am, _ = tg.tokenize_prompts(tok, prompts, 64, "cpu")
    # teacher forcing on answer + EOS (the answer: the prompt before "=", reversed); -mean of its log-probs
    target = torch.tensor([tok(p[:-1][::-1], add_special_tokens=False).input_ids + [tok.eos_token_id]
                           for p in prompts])
    z = full_forward(model, ids, am, target, torch.ones_like(target))
    (-torch.log_softmax(z, -1).gather(-1, target[..., None]).mean()).backward()
    for name, param in model.named_parameters():
        for r in ranks:
            torch.testing.assert_close(r["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_two_ranks_warm_up_with_fewer_rows_than_ranks_refuses_in_one_line(tmp_path):
    res = run_cli(*FAST, "--sft_batch_size", "1", "--sft_warmup_steps", "2", "--max_steps", "1", "--save_dir", tmp_path,
                  nproc=2, timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 1 and 1 <= len(errors) <= 2, res.stderr[-3000:]   # torchrun may stop a rank first
    assert set(errors) == {"error: the supervised warm-up shares --sft_batch_size 1 rows among 2 ranks, one at "
                           "least each: use --sft_batch_size >= 2 or --sft_warmup_steps 0"}
    assert 'train_grpo.py", line' not in res.stderr                            # no traceback of the trainer
