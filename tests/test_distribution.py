"""Sample and score the same distribution: what generate samples from is what the loss scores (the ratio and the
KL see no gap), rewards see the text as generated, and resume, lr and batch std are what they claim."""
import json
import math
import statistics

import pytest
import torch

import helpers
from helpers import FAST, dist_suite, tg, tiny
from test_real_path import GSM8K_REWARDS, REAL, SAMPLE, load_final, save_tiny


def rollout_with_scores(model, tok, generation_config, temperature, do_sample=True, seed=0, prompts=None,
                        max_gen_len=6):
    """helpers.rollout_with_scores, 4 samples per prompt, under what a checkpoint's generation_config.json may
    carry (the rollout must set it aside)."""
    for k, v in generation_config.items():
        setattr(model.generation_config, k, v)
    # prompts of different lengths: left padding, so the re-forward's position ids must be generate's
    prompts = [p for p in (prompts or ("abc=", "hgfedcba=", "ba=", "cabde=")) for _ in range(4)]
    return helpers.rollout_with_scores(model, tok, prompts, max_gen_len, temperature, do_sample, seed)


CHECKPOINT_GENERATION_CONFIG = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 4}


def tiny_gpt2():
    """Learned absolute positions (RoPE models are blind to a shift of all positions): left padding shows."""
    from transformers import GPT2Config, GPT2LMHeadModel
    tok = tg.build_char_tokenizer(tg.REVERSE_ALPHABET + "=")
    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                       bos_token_id=tok.eos_token_id))
    tg.disable_dropout(model)  # as the trainer does (GPT-2's config has dropout 0.1)
    return model, tok


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_scores_are_the_log_probs_the_loss_uses(temperature, arch):
    model, tok = tiny(seed=1) if arch == "qwen3" else tiny_gpt2()
    input_ids, attn, comp, mask, scores = rollout_with_scores(model, tok, CHECKPOINT_GENERATION_CONFIG, temperature)
    T = comp.shape[1]
    sampler = torch.log_softmax(scores.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
    logps, _, _ = tg.completion_logps(model, input_ids, attn, T, temperature=temperature, chunk_size=2)
    m = mask.bool()
    torch.testing.assert_close(logps[m], sampler[m], rtol=0, atol=1e-5)
    # and both are log_softmax(z / temperature) of a plain full forward: an independent computation
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1].double()
    want = torch.log_softmax(z / temperature, -1).gather(-1, comp[..., None]).squeeze(-1)
    torch.testing.assert_close(logps[m].double(), want[m], rtol=0, atol=1e-5)


def test_greedy_eval_ignores_the_checkpoint_generation_config():
    model, tok = tiny(seed=1)
    input_ids, attn, comp, mask, scores = rollout_with_scores(model, tok, CHECKPOINT_GENERATION_CONFIG, 1.0,
                                                              do_sample=False)
    T = comp.shape[1]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1]
    m = mask.bool()
    assert torch.equal(z.argmax(-1)[m], comp[m])  # each greedy token is the plain argmax: no penalty applied


def family(name):
    """Small random models of the families that post-process lm_head's output in their forward."""
    from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, GraniteConfig,
                              GraniteForCausalLM)
    kw = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
              bos_token_id=2)
    torch.manual_seed(0)
    if name == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=2.0, **kw))
    elif name == "granite":
        model = GraniteForCausalLM(GraniteConfig(logits_scaling=8.0, **kw))
    else:
        model = CohereForCausalLM(CohereConfig(logit_scale=0.0625, **kw))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100)   # logits large enough for the post-processing to matter
    return model.eval()


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere"])
def test_log_probs_follow_the_models_own_output_distribution(name):
    model = family(name)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 40, (3, 9), generator=g)
    attn = torch.ones_like(input_ids)
    attn[0, :2] = 0                                                               # one left-padded row
    T = 4
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids, attention_mask=attn, position_ids=pos, output_hidden_states=True)
    targets = input_ids[:, -T:]
    want = torch.log_softmax(out.logits[:, -T - 1:-1].double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    raw = torch.log_softmax(model.lm_head(out.hidden_states[-1][:, -T - 1:-1]).double(), -1)
    raw = raw.gather(-1, targets[..., None]).squeeze(-1)
    assert (raw - want).abs().max() > 0.1, "the family's post-processing must matter for this test to mean much"
    logps, _, _ = tg.completion_logps(model, input_ids, attn, T, chunk_size=3)
    torch.testing.assert_close(logps.double(), want, rtol=0, atol=1e-4)
    tg.check_output_head(model)  # passes: the trainer knows this family


def test_unknown_logit_post_processing_is_refused():
    model, _ = tiny()

    def double_logits(module, args, out):
        out.logits = out.logits * 2
        return out
    model.register_forward_hook(double_logits)
    with pytest.raises(tg.TrainerError, match="post-processes its logits"):
        tg.check_output_head(model)


def test_kl_is_zero_before_the_first_update_with_dropout_in_the_config(tmp_path):
    from transformers import AutoConfig
    model_dir = tmp_path / "dropout"
    save_tiny(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    config.attention_dropout = 0.5
    config.save_pretrained(model_dir)
    tg.main(REAL + ["--model_name_or_path", str(model_dir), "--dataset", SAMPLE, *GSM8K_REWARDS, "--max_steps", "1",
                    "--beta", "0.04", "--num_iterations", "2", "--save_dir", str(tmp_path / "run")])
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    # the reference is the policy before step 1, old = the policy that sampled: without dropout the first
    # update's KL is exactly 0; dropout on in the policy forward made it 3.65e-2 on the built-in model
    assert row["kl"] == 0.0
    assert AutoConfig.from_pretrained(tmp_path / "run" / "final").attention_dropout == 0.5  # the config is kept


def full_forward(model, prompt_ids, prompt_mask, comp, mask):
    """Plain forward over prompt + completion: logits [rows, T, V] at the completion positions, in float64."""
    ids, attn = torch.cat([prompt_ids, comp], 1), torch.cat([prompt_mask, mask], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return model(ids, attention_mask=attn, position_ids=pos).logits[:, -comp.shape[1] - 1:-1].double()


def test_truncated_completions_are_rewarded_on_their_text_and_every_metric_covers_every_row(tmp_path, monkeypatch):
    """--mask_truncated_completions 1, mu = 2, micro-batches of 4 rows. A truncated completion is rewarded on its
    text, completion_len is every completion's length before the masking, and the entropy (first update) and
    clip_ratio (last update) are over every row's tokens that the masking keeps, all computed here by hand."""
    seen, real = [], tg.reverse_reward

    def reverse_reward(completions, answer, **kw):  # records what the reward function is given
        values = real(completions, answer, **kw)
        seen.extend(zip(completions, values))
        return values
    monkeypatch.setattr(tg, "reverse_reward", reverse_reward)
    rolled, real_rollout = [], tg.rollout
    monkeypatch.setattr(tg, "rollout", lambda *a, **k: rolled.append((a, real_rollout(*a, **k))) or rolled[-1][1])
    weights, real_step = [], torch.optim.AdamW.step

    def step(self, *a, **k):  # the policy after each update
        out = real_step(self, *a, **k)
        weights.append([p.detach().clone() for p in self.param_groups[0]["params"]])
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    eps = 0.004
    # 4 new tokens cannot hold a 5-letter answer and its EOS: many completions are truncated
    tg.main(FAST + ["--max_steps", "1", "--max_gen_len", "4", "--mask_truncated_completions", "1",
                    "--num_iterations", "2", "--micro_batch_size", "4", "--epsilon", str(eps),
                    "--save_dir", str(tmp_path)])
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    (args, (comp, mask, truncated)), = rolled
    assert 4 <= truncated.sum() <= 12
    tok = tg.build_char_tokenizer(tg.REVERSE_ALPHABET + "=")
    cut = torch.nonzero(truncated).flatten().tolist()
    for i in cut:                                            # rewarded on the text as generated, not on ""
        assert seen[i][0] == tok.decode(comp[i], skip_special_tokens=True)
    assert sum(len(seen[i][0]) for i in cut) >= 2 * len(cut)
    assert row["reward"] == pytest.approx(statistics.mean(r for _, r in seen))
    # completion_len: each completion up to its first EOS, or all T tokens, before the masking
    ids = comp.tolist()
    lengths = [ids[i].index(tok.eos_token_id) + 1 if tok.eos_token_id in ids[i] else len(ids[i]) for i in range(16)]
    assert row["completion_len"] == pytest.approx(statistics.mean(lengths))
    assert statistics.mean(lengths) != pytest.approx(statistics.mean(l for i, l in enumerate(lengths) if i not in cut))
    # the tokens the loss and the metrics count: the completions that ended, up to their EOS
    kept = torch.tensor([[i not in cut and t < lengths[i] for t in range(comp.shape[1])] for i in range(16)])
    model, _ = tiny()                                   # the trainer's initial weights (same seed, same config)
    with torch.no_grad():
        logp0 = torch.log_softmax(full_forward(model, args[1], args[2], comp, kept.long()), -1)
        for p, w in zip(model.parameters(), weights[0]):
            p.copy_(w)
        logp1 = torch.log_softmax(full_forward(model, args[1], args[2], comp, kept.long()), -1)
    entropy = -(logp0.exp() * logp0).sum(-1)
    assert row["entropy"] == pytest.approx(entropy[kept].mean().item(), rel=1e-5)
    # clip_ratio of the second update: on-policy old = the sampler, the ratio against the policy after update 1
    pick = lambda lp: lp.gather(-1, comp[..., None]).squeeze(-1)
    ratio = torch.exp(pick(logp1) - pick(logp0))
    rewards = [r for _, r in seen]
    adv = []
    for g in range(0, 16, 4):
        grp = rewards[g:g + 4]
        tied = max(grp) == min(grp)
        adv += [0.0 if tied else (x - statistics.mean(grp)) / (statistics.stdev(grp) + 1e-4) for x in grp]
    A = torch.tensor(adv, dtype=torch.float64)[:, None].expand_as(ratio)
    clipped = ((ratio < 1 - eps) & (A < 0)) | ((ratio > 1 + eps) & (A > 0))
    assert ((ratio[kept] - (1 - eps)).abs().min() > 1e-5) and ((ratio[kept] - (1 + eps)).abs().min() > 1e-5)
    assert 0 < clipped[kept].sum() < kept.sum()
    assert row["clip_ratio"] == pytest.approx(clipped[kept].sum().item() / kept.sum().item(), rel=1e-9)


def test_saved_moe_checkpoint_resumes(tmp_path):
    moe_dir = save_tiny(tmp_path / "moe", moe=True)
    common = [*REAL, "--model_name_or_path", str(moe_dir), "--dataset", SAMPLE, *GSM8K_REWARDS, "--use_moe", "1",
              "--max_steps", "2"]
    assert tg.main([*common, "--save_dir", str(tmp_path / "a")])["step"] == 2
    assert tg.main([*common, "--stop_after", "1", "--save_dir", str(tmp_path / "b")])["step"] == 1
    assert tg.main([*common, "--resume", "auto", "--save_dir", str(tmp_path / "b")])["step"] == 2
    wa, wb = load_final(tmp_path / "a"), load_final(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_logged_lr_is_the_rate_each_step_used(tmp_path, monkeypatch):
    used = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        used.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    lr, warmup, steps = 1e-3, 3, 7
    tg.main(FAST + ["--batch_size", "1", "--num_generations", "2", "--max_gen_len", "2",   # the lr is all it reads
                    "--max_steps", str(steps), "--learning_rate", str(lr), "--warmup_steps", str(warmup),
                    "--lr_scheduler", "cosine", "--save_dir", str(tmp_path)])
    # by hand: step s (from 1) is update s - 1: warmup s / (warmup + 1), then 0.5 (1 + cos(pi (s - 1 - w) / (N - w)))
    hand = [lr * (s / (warmup + 1) if s <= warmup else 0.5 * (1 + math.cos(math.pi * (s - 1 - warmup) / (steps - warmup))))
            for s in range(1, steps + 1)]
    logged = [json.loads(l)["learning_rate"] for l in open(tmp_path / "metrics.jsonl")]
    assert logged == pytest.approx(hand, rel=1e-12) and used == pytest.approx(hand, rel=1e-12)


def test_batch_std_is_the_world_batch_std():
    r0, r1 = [torch.load(dist_suite() / f"batch_std_{r}.pt", weights_only=True) for r in (0, 1)]
    everything = r0["rewards"].tolist() + r1["rewards"].tolist()
    sd = statistics.stdev(everything)                                             # by hand, over both ranks
    assert r0["std"] == pytest.approx(sd, rel=1e-9) and r1["std"] == pytest.approx(sd, rel=1e-9)
    for r in (r0, r1):
        want = [(x - statistics.mean(r["rewards"].tolist())) / (sd + 1e-4) for x in r["rewards"].tolist()]
        assert r["adv"].tolist() == pytest.approx(want, abs=1e-6)


def test_every_world_quantity_of_the_step_is_the_worlds():
    """Each number grpo_step reduces over the ranks, against a hand computation from both ranks' data (which
    differ, so a number computed on one rank does not pass): (a) the batch std, (b) N, (c) the world entropy over
    every row's tokens, (d) the micro-batch count S, (e) the skip decision, which DDP's all-reduce shares,
    (f) the logged reward and advantage stds, (g) the logged means over every row of both ranks, (h) the KL and
    the counts of truncated completions and cut prompts."""
    r0, r1 = [torch.load(dist_suite() / f"world_{r}.pt", weights_only=True) for r in (0, 1)]   # world_quantities
    sd = statistics.stdev(r0["rewards"] + r1["rewards"])
    assert all(sd != pytest.approx(statistics.stdev(r["rewards"])) for r in (r0, r1))          # the data tell
    N = r0["tokens"] + r1["tokens"]
    assert r0["tokens"] != r1["tokens"]
    H = (r0["ent_sum"] + r1["ent_sum"]) / (r0["ent_count"] + r1["ent_count"])
    means = [r["ent_sum"] / r["ent_count"] for r in (r0, r1)]
    assert all(H != pytest.approx(x, rel=1e-3) for x in [*means, sum(means) / 2])  # nor a mean of rank means
    micro = 2
    for r in (r0, r1):
        assert r["batch_std"] == pytest.approx([sd, sd], rel=1e-12)                              # (a)
        assert r["num_items"] and set(r["num_items"]) == {N}                                     # (b)
        assert r["world_entropy"] == pytest.approx(H, rel=1e-5)                                  # (c)
        assert r["forwards"] == math.ceil(r["rows"] / micro) == 4                                # (d)
        assert r["skipped_after_1"] == 0 and r["skipped_after_2"] == 1 and not r["moved_in_2"]   # (e)
    assert all(math.isfinite(x) for x in r0["local_loss"])  # rank 0's own loss was finite: it skipped for rank 1
    # (f) the logged stds are TRL's: every row of both ranks, n - 1; A by hand (batch scale, a tied group gets 0)
    advantages = []
    for r in (r0, r1):
        for group in (r["rewards"][:4], r["rewards"][4:]):
            mean = sum(group) / 4
            tied = max(group) == min(group)
            advantages += [0.0 if tied else (x - mean) / (sd + 1e-4) for x in group]
    for r in (r0, r1):
        assert r["record"]["reward_std"] == pytest.approx(sd, rel=1e-9)
        assert r["record"]["advantage_std"] == pytest.approx(statistics.stdev(advantages), rel=1e-6)
    # (g) by hand: rank 0 has 1 tied group of 2, rank 1 none; lengths are the masks' row sums; the loss is each
    # rank's sum over its 4 micro-batches of step 1, averaged over the 2 ranks as DDP averages the gradients
    lengths = [[6, 5, 4, 3, 6, 2, 1, 6], [2, 2, 3, 1, 4, 6, 1, 3]]
    world_means = {"reward": statistics.mean(r0["rewards"] + r1["rewards"]), "frac_reward_zero_std": 1 / 4,
                   "completion_len": statistics.mean(lengths[0] + lengths[1]),
                   "loss": (sum(r0["local_loss"][:4]) + sum(r1["local_loss"][:4])) / 2,
                   "policy_loss": (sum(r0["local_policy_loss"][:4]) + sum(r1["local_policy_loss"][:4])) / 2,
                   "truncated_frac": (r0["no_eos"] + r1["no_eos"]) / 16}
    assert (r0["no_eos"], r1["no_eos"]) == (3, 1)                           # the rows of length T = 6, by hand
    assert r0["record"]["loss"] != pytest.approx(sum(r0["local_loss"][:4]), rel=1e-3)         # the data tell
    for r in (r0, r1):
        for key, value in world_means.items():
            assert r["record"][key] == pytest.approx(value, rel=1e-6), key
        assert r["record"]["tokens_per_s"] * r["record"]["step_time"] == pytest.approx(N, rel=1e-9)
    # (h) the KL is a token mean over both ranks, from a plain forward of each model; the cut prompts add up
    kl = (r0["kl_sum"] + r1["kl_sum"]) / N
    assert all(kl != pytest.approx(r["kl_sum"] / r["tokens"], rel=1e-3) for r in (r0, r1))   # the data tell
    for r in (r0, r1):
        assert r["record"]["kl"] == pytest.approx(kl, rel=1e-5)
        assert r["record"]["prompts_cut"] == r0["cut"] + r1["cut"] == 3
