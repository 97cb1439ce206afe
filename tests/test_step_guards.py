"""Three behaviours of a full grpo_step, each pinned against an independent computation (a plain full-logits
forward of the model, with autograd for the gradients, and the formulas written out by hand here):

1. dr_grpo divides by B*G*L_max with L_max = --max_gen_len, not by the width of the step's completions.
2. The rollout samples at --temperature.
3. With --num_iterations 2, the entropy bonus is in the gradient of every update, not only the first.
"""
import copy

import pytest
import torch

from helpers import FAST, make_run, sample_batch, step_on_batch, tg, tiny


def plain_logits(model, input_ids, attention_mask, T):
    """A plain forward over prompt + completion: the logits [rows, T, V] that score the T completion tokens."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, -T - 1:-1].double()


def test_dr_grpo_divides_by_max_gen_len_when_every_completion_stops_early():
    """dr_grpo's divisor is B*G*L_max, a constant, with L_max = --max_gen_len. When every completion of a step
    stops early, generate returns fewer than L_max columns, and the batch width T is not L_max. This step's 8
    completions all end with EOS within 4 columns while --max_gen_len is 32, so a divisor of B*G*T would make
    the loss and the gradient 8 times too large. On-policy (mu = 1, beta = 0, ratio 1) the dr_grpo loss is
    -sum_{i,t} A_i m_{i,t} / (B*G*L_max) in value, and its gradient is that of -sum A m logp / (B*G*L_max)."""
    model, tok = tiny()
    eos = tok.eos_token_id
    pad = tok.pad_token_id
    a, b, c = tok("abc", add_special_tokens=False).input_ids
    prompt_1 = tok("abc=", add_special_tokens=False).input_ids
    prompt_2 = tok("hgf=", add_special_tokens=False).input_ids
    # 2 prompts x G = 4 completions. Every completion ends with its EOS within 4 columns: lengths 1 to 4.
    completions = [[eos, pad, pad, pad],
                   [a, eos, pad, pad],
                   [b, c, eos, pad],
                   [c, b, a, eos],
                   [a, b, c, eos],
                   [eos, pad, pad, pad],
                   [c, eos, pad, pad],
                   [a, a, eos, pad]]
    lengths = torch.tensor([1, 2, 3, 4, 4, 1, 2, 3])
    comp = torch.tensor(completions)
    mask = (torch.arange(4)[None, :] < lengths[:, None]).long()        # 1 up to and including the EOS
    prompts = torch.tensor([prompt_1] * 4 + [prompt_2] * 4)
    input_ids = torch.cat([prompts, comp], 1)
    attention_mask = torch.cat([torch.ones_like(prompts), mask], 1)
    advantages = torch.tensor([1.5, -0.5, 0.5, -1.5, 0.3, -1.2, 0.9, 0.0])
    rows = 8
    max_gen_len = 32
    T = comp.shape[1]
    assert T == 4 and T < max_gen_len

    # The expected loss and gradient by hand, at the weights the step starts from.
    A = advantages.double()[:, None]
    m = mask.double()
    want_loss = -(A * m).sum().item() / (rows * max_gen_len)
    logp = torch.log_softmax(plain_logits(model, input_ids, attention_mask, T), -1)
    logp = logp.gather(-1, comp[..., None]).squeeze(-1)
    surrogate = -(A * m * logp).sum() / (rows * max_gen_len)
    want_grads = torch.autograd.grad(surrogate, list(model.parameters()))

    args = tg.parse_args(["--loss_type", "dr_grpo", "--batch_size", "2", "--num_generations", "4",
                          "--max_gen_len", str(max_gen_len), "--grad_clip", "0"])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, mask=mask, advantages=advantages)
    record, received = step_on_batch(args, run, batch)

    # The same numbers divided by B*G*T instead would be 8 times larger: far outside these tolerances.
    assert record["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert record["policy_loss"] == pytest.approx(want_loss, rel=1e-5)
    assert len(received) == 1
    for got, want in zip(received[0], want_grads):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-7)


def test_rollout_samples_at_the_temperature_flag(tmp_path, monkeypatch):
    """The rollout must sample from softmax(z / --temperature), the distribution the ratio and the entropy score.
    One real step of the loop (tg.main) at --temperature 0.5 runs with its rollout wrapped: the wrapper copies the
    policy that samples and asks generate for its processed scores, without changing any argument the step
    passes. The log_softmax of those scores, at every position of every completion up to its EOS, must equal
    log_softmax(z / 0.5) of a plain forward of the copied policy. Sampling at 1.0 instead gives log_softmax(z),
    which differs from it by far more than the tolerance (checked below)."""
    temperature = 0.5
    captured = []
    real_rollout = tg.rollout

    def rollout(policy, prompt_ids, prompt_mask, tokenizer, **kwargs):
        sampler = copy.deepcopy(policy)                           # the weights that sample, kept for the check
        real_generate = policy.generate
        scores = []

        def generate(**generate_kwargs):
            config = generate_kwargs["generation_config"]
            config.output_scores = True
            config.return_dict_in_generate = True
            out = real_generate(**generate_kwargs)
            scores.append(torch.stack(out.scores, 1))          # [rows, T, V], after temperature
            return out.sequences
        policy.generate = generate
        try:
            result = real_rollout(policy, prompt_ids, prompt_mask, tokenizer, **kwargs)
        finally:
            del policy.generate
        captured.append((sampler, prompt_ids, prompt_mask, result, scores[0]))
        return result
    monkeypatch.setattr(tg, "rollout", rollout)
    tg.main(FAST + ["--max_steps", "1", "--temperature", str(temperature), "--save_dir", str(tmp_path)])

    assert len(captured) == 1                                     # one step, no eval: one rollout
    sampler, prompt_ids, prompt_mask, (comp, mask, _), scores = captured[0]
    T = comp.shape[1]
    input_ids = torch.cat([prompt_ids, comp], 1)
    attention_mask = torch.cat([prompt_mask, mask], 1)
    with torch.no_grad():
        z = plain_logits(sampler, input_ids, attention_mask, T)
    m = mask.bool()
    sampled = torch.log_softmax(scores.double(), -1)[m]           # [tokens, V]: what generate sampled from
    want = torch.log_softmax(z / temperature, -1)[m]
    at_one = torch.log_softmax(z, -1)[m]
    # The check can tell the two temperatures apart: they differ by much more than its tolerance.
    assert (want - at_one).abs().max().item() > 0.05
    torch.testing.assert_close(sampled, want, rtol=0, atol=1e-4)


def test_entropy_bonus_is_in_the_gradient_of_every_update():
    """With --num_iterations 2 and --entropy_coef 0.1, each of the two updates adds -0.1 times the token mean
    of the entropy H of softmax(z / --temperature) to its loss, so both gradients carry the bonus. Every
    advantage is 0, so the policy term adds exactly 0 to the gradient and each update's gradient is the bonus's
    alone. An optimizer step pre-hook copies the model just before each update's step: those are the weights
    the update's gradient was taken at (SGD with lr 1 moves them between the two updates). The reference is the
    gradient, by autograd on that copy, of -0.1 * sum(H m) / sum(m) from a plain forward. A bonus applied on the
    first update only leaves the second update's gradient at 0, which fails the comparison."""
    coef = 0.1
    temperature = 0.7
    model, tok = tiny()
    input_ids, attention_mask, comp, mask = sample_batch(model, tok)      # 16 rows of a real rollout
    T = comp.shape[1]
    args = tg.parse_args(["--batch_size", "4", "--num_generations", "4", "--num_iterations", "2",
                          "--entropy_coef", str(coef), "--temperature", str(temperature), "--grad_clip", "0"])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    weights_at_update = []

    def copy_weights(opt, *_):
        weights_at_update.append(copy.deepcopy(model))
    optimizer.register_step_pre_hook(copy_weights)
    run = make_run(model, tok, optimizer)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, mask=mask, advantages=torch.zeros(16))
    _, received = step_on_batch(args, run, batch, tg.TrainState.initial(args))

    assert len(received) == 2 and len(weights_at_update) == 2
    first = dict(weights_at_update[0].named_parameters())
    second = dict(weights_at_update[1].named_parameters())
    moved = max((first[k] - second[k]).abs().max().item() for k in first)
    assert moved > 1e-5                                  # the second update's gradient is taken at new weights
    m = mask.double()
    for update, plain in enumerate(weights_at_update):
        plain.zero_grad(set_to_none=True)
        logp = torch.log_softmax(plain_logits(plain, input_ids, attention_mask, T) / temperature, -1)
        entropy = -(logp.exp() * logp).sum(-1)                            # [rows, T]
        bonus = -coef * (entropy * m).sum() / m.sum()
        want_grads = torch.autograd.grad(bonus, list(plain.parameters()))
        assert sum(w.abs().sum().item() for w in want_grads) > 1e-3     # a bonus gradient far from 0
        for got, want in zip(received[update], want_grads):
            torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-7,
                                       msg=lambda text: f"update {update + 1}: {text}")
