"""The loop's wiring, pinned by values: what grpo_step logs and computes, each against an independent
computation (a plain full-logits forward, the schedule by hand, the combined batch in one process)."""
import json

import pytest
import torch

from helpers import FAST, run_cli, spawn, tg, tiny
import dist_workers


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


@pytest.mark.parametrize("skip", [0, 1])
def test_logged_entropy_is_that_of_the_sampling_distribution(tmp_path, monkeypatch, skip):
    rollouts = []
    rows = logged(tmp_path, "--max_steps", "1", "--temperature", "0.7", "--skip_zero_advantage_rows", str(skip),
                  monkeypatch=monkeypatch, capture=rollouts)
    (args, (comp, mask, *_)), = rollouts
    model, tok = tiny()                                 # the trainer's initial weights (same seed, same config)
    with torch.no_grad():
        logp = torch.log_softmax(full_forward(model, args[1], args[2], comp, mask) / 0.7, -1)
    entropy = -(logp.exp() * logp).sum(-1)                                        # [rows, T] at temperature 0.7
    # skipping: over the rows trained on, those whose advantage is not 0 (a group whose rewards all tie)
    prompts = tok.batch_decode(args[1], skip_special_tokens=True)
    texts = [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(comp, mask)]
    rewards = torch.tensor([tg.reverse_reward(t, p[:-1][::-1]) for t, p in zip(texts, prompts)])
    grouped = rewards.view(-1, 4)
    trained = (grouped.amax(1) != grouped.amin(1)).repeat_interleave(4) if skip else torch.ones(len(texts))
    assert rows[0]["rows_trained"] == trained.sum() > 0 and (not skip or trained.sum() < len(texts))
    m = mask * trained[:, None]
    want = (entropy * m).sum() / m.sum()
    assert rows[0]["entropy"] == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("sampling", [[], ["--top_p", "0.7"]])
def test_kl_is_zero_at_step_1_then_positive_against_a_frozen_reference(tmp_path, sampling):
    # top_p 0.7 under sampling replay: the policy and the reference each score their own nucleus (the
    # sampled token kept); at equal weights those are one distribution, and the KL is 0 there too
    rows = logged(tmp_path, "--max_steps", "3", "--beta", "0.04", "--learning_rate", "1e-3", *sampling)
    kl = [r["kl"] for r in rows]
    assert kl[0] == 0.0                   # the reference is the policy before the first update
    assert kl[1] > 1e-6 and kl[2] > 1e-6  # the policy moved, the reference did not


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
    batch = dict(input_ids=input_ids, attention_mask=attn, mask=mask, advantages=torch.randn(16),
                 sampler_logps=torch.zeros_like(mask, dtype=torch.float))
    seen, real = [], tg.completion_logps
    monkeypatch.setattr(tg, "completion_logps", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    for coef in (0.0, 0.01):
        seen.clear()
        run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
        record, _ = step_on_batch(args, run, batch, tg.TrainState(alpha=coef))
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


def test_two_ranks_with_micro_steps_equal_one_process_on_the_combined_batch(tmp_path):
    import statistics
    spawn(dist_workers.loop_step_grads, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    tok = tg.build_char_tokenizer(tg.REVERSE_ALPHABET + "=")
    model, _ = tiny()
    for loss_type in ("dapo", "cispo", "grpo"):
        parts = [r[loss_type] for r in ranks]
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
                                           msg=lambda m: f"{loss_type} {name}: {m}")


def warm_up_grads(rank, world, out_dir):
    """One supervised warm-up step of --batch_size 3 on 2 ranks: the prompts this rank took and the gradient
    the clip saw (after DDP's all-reduce)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.distributed.init_process_group("gloo")
    model, tok = tiny()
    seen, real_tokenize, real_clip = {}, tg.tokenize_prompts, tg.clip_grad_norm

    def tokenize(tok, prompts, *a, **k):
        seen["prompts"] = prompts
        return real_tokenize(tok, prompts, *a, **k)

    def clip(m, max_norm):
        seen["grads"] = {n: p.grad.clone() for n, p in m.named_parameters()}
        return real_clip(m, max_norm)
    tg.tokenize_prompts, tg.clip_grad_norm = tokenize, clip
    args = tg.parse_args(["--sft_warmup_steps", "1", "--batch_size", "3"])
    tg.sft_warmup(DDP(model), tok, tg.make_reverse_task(16)[0], args, "cpu", rank, world)
    torch.save(seen, f"{out_dir}/warm{rank}.pt")
    dist_workers.close_group()


def test_two_ranks_warm_up_on_an_uneven_split_takes_the_mean_over_the_whole_batch(tmp_path):
    spawn(warm_up_grads, str(tmp_path))
    ranks = [torch.load(tmp_path / f"warm{r}.pt", weights_only=True) for r in (0, 1)]
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
    res = run_cli(*FAST, "--batch_size", "1", "--sft_warmup_steps", "2", "--max_steps", "1", "--save_dir", tmp_path,
                  nproc=2, timeout=120)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 1 and 1 <= len(errors) <= 2, res.stderr[-3000:]   # torchrun may stop a rank first
    assert set(errors) == {"error: the supervised warm-up shares --batch_size 1 rows among 2 ranks, one at "
                           "least each: use --batch_size >= 2 or --sft_warmup_steps 0"}
    assert 'train_grpo.py", line' not in res.stderr                            # no traceback of the trainer
