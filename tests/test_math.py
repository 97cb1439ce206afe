"""The formulas of steps 2, 4, 8, 9 (README, "The math") against hand-derived values."""
import math
import statistics

import pytest
import torch

from helpers import tg

LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]


def batch(rows=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(rows, T, generator=g) * 3).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]][:rows], dtype=torch.float32)
    adv = torch.tensor([1.5, -0.5, 0.25][:rows])
    return logps, mask, adv


def expected_grad(loss_type, adv, mask, *, L_max, N, world, S):
    """On-policy (ratio = 1) the gradient of every loss is -A_i * m_it times its normalizer."""
    rows = mask.shape[0]
    g = torch.zeros_like(mask)
    for i in range(rows):
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            if loss_type == "grpo":
                norm = mask[i].sum().item() * rows * S       # 1/|o_i| / rows / S
            elif loss_type == "bnpo":
                norm = mask.sum().item() * S                 # 1/sum(m) / S
            elif loss_type == "dr_grpo":
                norm = rows * L_max * S                      # 1/(rows L_max) / S
            else:
                norm = N / world                             # 1/(N / world)
            g[i, t] = -adv[i].item() / norm
    return g


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("S", [1, 2])
def test_gradient_oracle_on_policy(loss_type, S):
    logps, mask, adv = batch()
    L_max, N, world = 7, 20.0, 2
    eps_h = 5.0 if loss_type == "cispo" else 0.28  # cispo's eps_h is a weight cap, min(1, 5.0) = 1 on-policy
    loss, _ = tg.policy_objective(logps, logps.detach(), adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=eps_h,
                           divisor=tg.loss_divisor(loss_type, mask.shape[0] * S, mask.shape[0], N, world, L_max))
    loss.backward()
    want = expected_grad(loss_type, adv, mask, L_max=L_max, N=N, world=world, S=1 if loss_type in ("dapo", "cispo") else S)
    torch.testing.assert_close(logps.grad, want, rtol=1e-6, atol=1e-7)


def test_self_subtraction_in_graph_has_zero_gradient_and_trainer_path_does_not():
    logps, mask, adv = batch()
    # the famous bug: old taken from the same graph, ratio = exp(x - x)
    ratio = torch.exp(logps - logps)
    bug = -(ratio * adv[:, None] * mask).sum()
    (g_bug,) = torch.autograd.grad(bug, logps)
    assert torch.count_nonzero(g_bug) == 0
    # the trainer's path: old is detached, so the gradient is -A m (times the grpo normalization)
    loss, _ = tg.policy_objective(logps, logps.detach(), adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                           divisor=mask.shape[0])
    (g,) = torch.autograd.grad(loss, logps)
    want = -adv[:, None] * mask / mask.sum(1, keepdim=True) / mask.shape[0]
    torch.testing.assert_close(g, want)
    with pytest.raises(AssertionError):
        tg.policy_objective(logps, logps, adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.2, divisor=mask.shape[0])


def test_clipped_tokens_get_exactly_zero_gradient():
    eps, eps_h = 0.2, 0.3
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.9]])  # one row per advantage sign below
    old = torch.zeros(2, 4)
    logps = torch.log(ratios.repeat(2, 1)).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    loss, stats = tg.policy_objective(logps, old, adv, mask, loss_type="bnpo", epsilon=eps, epsilon_high=eps_h, divisor=1)
    loss.backward()
    r = ratios[0]
    # A > 0: r = 1.5 > 1 + eps_h is clipped (0); r = 0.5 is on the unclipped side: -A r / N
    # A < 0: r = 0.5 < 1 - eps is clipped (0); r = 1.5 is unclipped: -A r / N
    N = 8
    want = torch.tensor([[0.0, -r[1] / N, -r[2] / N, -r[3] / N],
                         [r[0] / N, 0.0, r[2] / N, r[3] / N]])
    torch.testing.assert_close(logps.grad, want)
    assert stats["clipped_tokens"].item() == 2            # of the 8 masked tokens


def test_cispo_weight_is_capped_and_carries_no_gradient():
    cap = 2.0
    ratios = torch.tensor([[0.5, 1.0, 3.0, 10.0]])
    logps = torch.log(ratios).requires_grad_()
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 4)
    loss, _ = tg.policy_objective(logps, torch.zeros(1, 4), adv, mask, loss_type="cispo", epsilon=0.2, epsilon_high=cap,
                           divisor=4.0)
    loss.backward()
    # L = -sg(min(r, cap)) A logp / N  =>  dL/dlogp = -min(r, cap) A / N   (no extra r*logp term)
    want = -torch.clamp(ratios, max=cap) * 2.0 / 4
    torch.testing.assert_close(logps.grad, want)
    torch.testing.assert_close(loss, -(torch.clamp(ratios, max=cap) * 2.0 * torch.log(ratios)).sum() / 4)


def test_cispo_clip_ratio_counts_capped_tokens_with_positive_advantage():
    cap = 2.0
    ratios = torch.tensor([[0.5, 3.0, 10.0, 1.0], [3.0, 10.0, 0.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    _, stats = tg.policy_objective(torch.log(ratios), torch.zeros(2, 4), torch.tensor([1.0, -1.0]), mask, loss_type="cispo",
                            epsilon=0.2, epsilon_high=cap, divisor=7.0)
    # by hand, as TRL counts: r > cap and A > 0, over the 7 masked tokens: row 0's 3.0 and 10.0; row 1 (A < 0)
    # has r > cap twice too, but there the cap only shrinks a push down: not counted
    assert stats["clipped_tokens"].item() == 2            # of the 7 masked tokens


def test_k3_kl_matches_hand_computation():
    logps, mask, adv = batch()
    ref = logps.detach() + torch.tensor([[0.1, -0.2, 0.3, 0.0, 0.5], [0.0, 0.05, -0.1, 0.2, -0.3], [0.4, -0.4, 9, 9, 9]])
    beta = 0.04
    loss, stats = tg.policy_objective(logps, logps.detach(), adv, mask, loss_type="bnpo", epsilon=0.2, epsilon_high=0.2,
                               divisor=1, ref_logps=ref, beta=beta)
    kls, grads = [], torch.zeros_like(mask)
    n = mask.sum().item()
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                d = ref[i, t].item() - logps[i, t].item()
                kls.append(math.exp(d) - d - 1)
                grads[i, t] = (-adv[i].item() + beta * (1 - math.exp(d))) / n  # d/dlogp of -A r + beta KL
    assert stats["kl_sum"].item() / n == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert loss.item() == pytest.approx((-adv[:, None] * mask).sum().item() / n + beta * sum(kls) / n, rel=1e-5)
    loss.backward()
    torch.testing.assert_close(logps.grad, grads, rtol=1e-5, atol=1e-6)


def test_advantages_match_hand_computation():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0]
    adv = tg.compute_advantages(torch.tensor(rewards), 4, "group")
    for g in range(2):
        grp = rewards[4 * g:4 * g + 4]
        mu, sd = statistics.mean(grp), statistics.stdev(grp)
        for j, r in enumerate(grp):
            assert adv[4 * g + j].item() == pytest.approx((r - mu) / (sd + 1e-4), abs=1e-5)
    assert torch.all(adv[4:] == 0) and not torch.isnan(adv).any()  # a group of ties: 0, not NaN
    batch_sd = statistics.stdev(rewards)
    adv_b = tg.compute_advantages(torch.tensor(rewards), 4, "batch")
    assert adv_b[0].item() == pytest.approx((1.0 - 0.5) / (batch_sd + 1e-4), abs=1e-5)
    adv_n = tg.compute_advantages(torch.tensor(rewards), 4, "none")
    assert adv_n.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0, 0, 0, 0])


def test_mask_keeps_first_eos_and_nothing_after():
    eos, pad = 1, 0
    ids = torch.tensor([[5, 6, eos, pad, pad],
                        [eos, 7, eos, 8, 9],
                        [5, 6, 7, 8, 9]])
    mask, truncated = tg.completion_mask(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_selective_log_softmax_matches_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 50, generator=g) * 4
    idx = torch.randint(0, 50, (3, 7), generator=g)
    want = torch.log_softmax(logits.double(), -1).gather(-1, idx[..., None]).squeeze(-1)
    torch.testing.assert_close(tg.selective_log_softmax(logits, idx).double(), want, rtol=1e-5, atol=1e-5)


def test_reverse_reward():
    got = tg.reverse_reward(["dcba", "dcxx", "dcbaa", ""], answer=["dcba"] * 4)
    assert got == pytest.approx([1.0, 0.5, 4 / 5, 0.0])


def test_asymmetric_clip_bounds_and_the_clip_count_by_advantage_sign():
    eps, eps_h = 0.2, 0.4     # [0.8, 1.4]: the test ratios 0.7 and 1.3 lie between the swapped and the right bounds
    ratios = torch.tensor([[1.3, 1.5, 1.6, 0.7], [0.7, 1.3, 0.5, 1.6]])
    logps = torch.log(ratios).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 4)
    loss, stats = tg.policy_objective(logps, torch.zeros(2, 4), adv, mask, loss_type="bnpo", epsilon=eps, epsilon_high=eps_h,
                               divisor=1)
    loss.backward()
    # by hand: A > 0 is clipped where r > 1 + eps_h; A < 0 where r < 1 - eps. Clipped tokens: gradient 0;
    # the others -A r / N (d/dlogp of -r A)
    N = 8
    clipped = torch.tensor([[False, True, True, False], [True, False, True, False]])
    want = torch.where(clipped, torch.zeros(2, 4), -adv[:, None] * ratios / N)
    torch.testing.assert_close(logps.grad, want)
    assert stats["clipped_tokens"].item() == clipped.sum().item()   # 4 of 8
