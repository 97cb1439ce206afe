"""Entropy (steps 7, 10, 11): chunked, graph-free when only logged, one coefficient for the world."""
import json

import pytest
import torch

from helpers import FAST, dist_suite, make_run, sample_batch, step_on_batch, tg, tiny


def naive_entropy(logits):
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("shape", [(37, 50), (3, 13, 50)])
def test_entropy_matches_full_softmax_fp32(shape):
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 5
    got = tg.entropy_from_logits(logits)
    assert got.shape == shape[:-1]
    torch.testing.assert_close(got.double(), naive_entropy(logits), rtol=0, atol=1e-5)


def test_entropy_bf16_within_rounding_bound():
    logits = torch.randn(4, 9, 300, generator=torch.Generator().manual_seed(1)) * 4
    low = logits.bfloat16()
    got = tg.entropy_from_logits(low).double()
    # exact on the bf16 values themselves (the chunk is computed in fp32) ...
    torch.testing.assert_close(got, naive_entropy(low.float()), rtol=0, atol=1e-5)
    # ... and against fp32 logits, within the rounding: dH/dz_v = -p_v (z_v - E_p z), so
    # |dH| <= sum_v p_v |z_v - E_p z| * max|dz| <= 2 max|z| max|dz| (first order, x1.5 for safety)
    bound = 1.5 * 2 * logits.abs().max() * (logits - low.float()).abs().max()
    assert (got - naive_entropy(logits)).abs().max() <= bound


def saved_bytes(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


def chunk_inputs():
    model, tok = tiny()
    hidden = torch.randn(6, 5, 64, requires_grad=True)
    targets = torch.randint(0, len(tok), (6, 5))
    return model, hidden, targets


def test_logged_entropy_saves_nothing_for_backward():
    model, hidden, targets = chunk_inputs()
    without, _ = saved_bytes(lambda: tg._chunk_logps_entropy(model, hidden, targets, 1.0, False, with_entropy=False))
    logged, (lp, ent) = saved_bytes(lambda: tg._chunk_logps_entropy(model, hidden, targets, 1.0, False))
    in_graph, (_, ent_g) = saved_bytes(lambda: tg._chunk_logps_entropy(model, hidden, targets, 1.0, True))
    assert logged == without and not ent.requires_grad
    assert in_graph > without and ent_g.requires_grad  # the deliberately non-detached version keeps softmax & co


def test_trainer_forward_saves_same_bytes_with_and_without_entropy():
    model, tok = tiny()
    input_ids, attn, comp, mask = sample_batch(model, tok)
    T = comp.shape[1]
    run = lambda **kw: saved_bytes(lambda: tg.completion_logps(model, input_ids, attn, T, chunk_size=2, **kw))[0]
    base = run(with_entropy=False)
    assert run(entropy_grad=False) == base
    # the same measurement catches the known bug: one full-logits forward, entropy in the graph or not
    def full_logits(entropy):
        logits = model(input_ids, attention_mask=attn).logits[:, -T - 1:-1]
        if entropy == "graph":
            naive_entropy(logits.float())
        elif entropy == "detached":
            with torch.no_grad():
                tg.entropy_from_logits(logits.detach())
    plain = saved_bytes(lambda: full_logits(None))[0]
    assert saved_bytes(lambda: full_logits("detached"))[0] == plain
    assert saved_bytes(lambda: full_logits("graph"))[0] > plain


def naive_loss(model, input_ids, attn, comp, mask, adv, alpha, with_aux):
    """The plain path: full [rows, T, V] logits, log_softmax, entropy -sum p log p, grpo normalization by hand,
    and the bonus alpha times the token mean of the entropy."""
    T = comp.shape[1]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids, attention_mask=attn, position_ids=pos,
                **({"output_router_logits": True} if with_aux else {}))
    logp_all = torch.log_softmax(out.logits[:, -T - 1:-1].float(), -1)
    logps = logp_all.gather(-1, comp[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    per_tok = -torch.exp(logps - logps.detach()) * adv[:, None]
    loss = ((per_tok * mask).sum(1) / mask.sum(1)).mean() - alpha * (ent * mask).sum() / mask.sum()
    if with_aux:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


@pytest.mark.parametrize("use_moe", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.05, -0.02])
def test_chunked_path_equals_full_logits_path(use_moe, alpha):
    model, tok = tiny(use_moe)
    input_ids, attn, comp, mask = sample_batch(model, tok)
    mask = mask.float()
    adv = torch.randn(comp.shape[0], generator=torch.Generator().manual_seed(3))
    logps, ent, aux = tg.completion_logps(model, input_ids, attn, comp.shape[1], chunk_size=2,
                                          entropy_grad=alpha != 0)
    loss, _ = tg.policy_objective(logps, logps.detach(), adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                           divisor=mask.shape[0])
    loss = loss - alpha * (ent * mask).sum() / mask.sum()  # the bonus as grpo_step adds it (S = 1)
    if use_moe:
        loss = loss + model.config.router_aux_loss_coef * aux
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = naive_loss(model, input_ids, attn, comp, mask, adv, alpha, use_moe)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_entropy_bonus_is_the_same_for_every_loss_type(loss_type):
    """grpo_step adds -alpha * share * sum(H m) / max(sum m, 1) for each micro-batch, whatever the loss type (TRL),
    share being the micro-batch's part of the rows, never divided by the loss's divisor D. With every advantage 0
    the bonus is all of the gradient; the reference is alpha times the gradient of the micro-batches' token means
    of H, each weighted by its rows over 16, by a full forward."""
    model, tok = tiny()
    input_ids, attn, comp, mask = sample_batch(model, tok)                       # 16 rows
    alpha, micro, T = 0.05, 6, comp.shape[1]                                     # S = 3: 6, 6 and 4 rows
    m = mask.double()
    counts = [m[j:j + micro].sum().item() for j in range(0, 16, micro)]
    assert len(set(counts)) == 3                 # the micro-batches' token means differ from the batch's
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logp = torch.log_softmax(model(input_ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1].double(), -1)
    H = -(logp.exp() * logp).sum(-1)                                             # [rows, T]
    bonus = sum((H[j:j + micro] * m[j:j + micro]).sum() / m[j:j + micro].sum() * len(m[j:j + micro]) / 16
                for j in range(0, 16, micro))
    want = torch.autograd.grad(-alpha * bonus, list(model.parameters()))
    args = tg.parse_args(["--loss_type", loss_type, "--batch_size", "4", "--num_generations", "4",
                          "--micro_batch_size", str(micro), "--grad_clip", "0", "--entropy_coef", str(alpha)])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = dict(input_ids=input_ids, attention_mask=attn, mask=mask, advantages=torch.zeros(16))
    _, received = step_on_batch(args, run, batch, tg.TrainState(entropy_coef_applied=alpha))
    for got, w in zip(received[0], want):
        torch.testing.assert_close(got, w.float(), rtol=1e-4, atol=1e-7)


def rule(c, h, target, delta, lo, hi):
    return (min(c + delta, hi), min(c + delta, hi)) if h < target else (max(c - delta, lo), 0.0)


def test_update_entropy_coef_rule():
    kw = dict(target=0.2, delta=0.001, coef_min=0.0, coef_max=0.0025)
    c, seen = 0.0, []
    for h in [0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3]:
        c, a = tg.update_entropy_coef(c, h, **kw)
        seen.append((round(c, 6), round(a, 6)))
    assert seen == [(0.001, 0.001), (0.002, 0.002), (0.0025, 0.0025), (0.0025, 0.0025),
                    (0.0015, 0.0), (0.0005, 0.0), (0.0, 0.0), (0.0, 0.0)]


def test_two_ranks_hold_one_coefficient_from_world_sums():
    logs = [json.load(open(dist_suite() / f"entropy_{r}.json")) for r in (0, 1)]
    c = c_bad = 0.0
    differs = False
    for s0, s1 in zip(*logs):
        assert s0["coef"] == s1["coef"] and s0["applied"] == s1["applied"]
        h_world = (s0["sum"] + s1["sum"]) / (s0["count"] + s1["count"])        # by hand, from both ranks
        c, a = rule(c, h_world, 0.2, 0.001, 0.0, 0.004)
        assert s0["coef"] == pytest.approx(c) and s0["applied"] == pytest.approx(a)
        h_bad = (s0["sum"] / s0["count"] + s1["sum"] / s1["count"]) / 2        # a mean of per-rank means
        c_bad, _ = rule(c_bad, h_bad, 0.2, 0.001, 0.0, 0.004)
        differs |= c_bad != pytest.approx(s0["coef"])
    assert differs, "the data must tell a world mean from a mean of per-rank means"


@pytest.mark.parametrize("adaptive", [0, 1])
def test_step_1_applies_no_adaptive_bonus_before_an_entropy_is_measured(tmp_path, adaptive):
    """Static: --entropy_coef from step 1. Adaptive: c starts at --entropy_coef, but the bonus waits for a world
    entropy (as TRL: nothing is applied before one is measured); step 1's H ~2.4 is above the target 0.2."""
    from helpers import FAST
    tg.main(FAST + ["--max_steps", "1", "--loss_type", "bnpo", "--entropy_coef", "0.003",
                    "--use_adaptive_entropy", str(adaptive), "--save_dir", str(tmp_path)])
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    alpha = 0.0 if adaptive else 0.003
    assert row["entropy_coef_applied"] == alpha and row["entropy"] > 0.2
    assert row["entropy_coef"] == pytest.approx(0.003 - 1e-4 if adaptive else 0.003, abs=1e-12)
    # what the loss applied: bnpo on one process normalizes the bonus like the logged entropy (a token mean)
    assert row["loss"] == pytest.approx(row["policy_loss"] - alpha * row["entropy"], rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("vocab", [151_936, 2 * 151_936])  # Qwen's vocabulary, and twice it
def test_largest_logits_tensor_stays_within_the_byte_budget_whatever_the_vocabulary(vocab):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         tie_word_embeddings=True))
    rows, T = 2, 64                                   # 128 completion tokens: more than one chunk at either vocabulary
    ids = torch.randint(0, vocab, (rows, 4 + T))
    shapes = []
    real = tg.lm_logits
    tg.lm_logits = lambda m, h: shapes.append(h.shape[0]) or real(m, h)
    try:
        logps, _, _ = tg.completion_logps(model, ids, torch.ones_like(ids), T,
                                          chunk_size=tg.Args().logp_chunk_size)   # the trainer's default: auto
        (-logps.sum()).backward()
    finally:
        tg.lm_logits = real
    budget = tg.LOGITS_BUDGET_MIB * 2**20
    assert max(shapes) * vocab * 4 <= budget                     # fp32 logits of the largest chunk, in bytes
    assert max(shapes) * vocab * 4 > budget - vocab * 4          # and the chunk is as large as the budget allows
    assert sum(shapes) == 2 * rows * T                           # forward, and the recompute in backward


def test_entropy_is_computed_only_where_it_is_logged(tmp_path, monkeypatch):
    """beta > 0 and mu = 2: four log-prob passes per step, two without grad (reference, old) and two
    updates; the entropy is logged from the first update alone, so it covers half the tokens of the two
    no-grad passes. The supervised warm-up logs none."""
    tokens = {"entropy": 0, "logps": 0}
    real_entropy, real_logps = tg.entropy_from_logits, tg.selective_log_softmax

    def entropy(z):
        tokens["entropy"] += z.numel() // z.shape[-1]
        return real_entropy(z)

    def logps(z, index):  # the no-grad passes only (an update's chunks are recomputed in backward)
        tokens["logps"] += 0 if torch.is_grad_enabled() else index.numel()
        return real_logps(z, index)
    monkeypatch.setattr(tg, "entropy_from_logits", entropy)
    monkeypatch.setattr(tg, "selective_log_softmax", logps)
    from helpers import FAST
    tg.main(FAST + ["--max_steps", "1", "--beta", "0.04", "--num_iterations", "2",
                    "--save_dir", str(tmp_path)])
    assert tokens["logps"] > 0 and 2 * tokens["entropy"] == tokens["logps"]
    model, tok = tiny()
    args = tg.parse_args(["--sft_warmup_steps", "2", "--sft_batch_size", "4"])
    tokens.update(entropy=0, logps=0)
    before = model.lm_head.weight.detach().clone()
    tg.sft_warmup(model, tok, tg.make_reverse_task(16)[0], args, torch.device("cpu"), 0, 1)
    assert not torch.equal(before, model.lm_head.weight) and tokens["entropy"] == 0


def test_a_step_with_every_token_masked_measures_entropy_0_as_trl(tmp_path, monkeypatch):
    """With an EOS id no token has, no completion ends, and --mask_truncated_completions masks every one: the
    world entropy is a sum of 0 over a count of 0, which TRL clamps to 1. The entropy is logged as 0, not NaN, and
    the adaptive rule reads it as below the target, so c rises by delta each step."""
    monkeypatch.setattr(tg, "eos_token_ids", lambda model, tokenizer: [10**6])
    tg.main(FAST + ["--max_steps", "2", "--max_gen_len", "2", "--mask_truncated_completions", "1",
                    "--use_adaptive_entropy", "1", "--entropy_coef", "0.001", "--save_dir", str(tmp_path)])
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["truncated_frac"] for r in records] == [1.0, 1.0]
    assert [r["entropy"] for r in records] == [0.0, 0.0]
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.0011, 0.0012], rel=1e-12)
