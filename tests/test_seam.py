"""The seam where a fork swaps the rollout: train_on_batch trains on a Batch built by hand from fixed completions,
with no rollout at all, exactly as on the same batch that collect_batch collects."""
import copy
import dataclasses
import json

import pytest
import torch

from helpers import FAST, make_run, tg, tiny

PROMPTS = [{"prompt": "abcde=", "answer": "edcba"}, {"prompt": "hgfed=", "answer": "defgh"}]
# G = 4 completions of each prompt. The last of the first group never stops: 6 letters, no EOS.
COMPLETIONS = ["edcba", "edcab", "abc", "edcbaa", "defgh", "d", "defhg", "hgfed"]
# reverse_reward by hand: the letters in the right place over the longer length.
REWARDS = [1.0, 3 / 5, 1 / 5, 5 / 6, 1.0, 1 / 5, 3 / 5, 1 / 5]
FLAGS = ["--batch_size", "2", "--num_generations", "4", "--max_gen_len", "6", "--grad_clip", "0"]


def hand_batch(tok):
    """The Batch of PROMPTS and COMPLETIONS, built from the tokenizer's ids and the formulas, not by the trainer."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    input_ids, attention_mask, completion_mask = [], [], []
    for i, text in enumerate(COMPLETIONS):
        prompt = tok(PROMPTS[i // 4]["prompt"], add_special_tokens=False).input_ids
        completion = tok(text, add_special_tokens=False).input_ids
        if len(completion) < 6:
            completion = completion + [eos]                    # stopped: the EOS is a token of the completion
        kept = [1] * len(completion) + [0] * (6 - len(completion))
        input_ids.append(prompt + completion + [pad] * (6 - len(completion)))
        attention_mask.append([1] * len(prompt) + kept)
        completion_mask.append(kept)
    rewards = torch.tensor(REWARDS)
    grouped = rewards.view(2, 4)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    mask = torch.tensor(completion_mask)
    return tg.Batch(input_ids=torch.tensor(input_ids), attention_mask=torch.tensor(attention_mask),
                    completion_mask=mask, advantages=advantages, rewards=rewards,
                    completion_len=mask.sum(1).float(), truncated=torch.tensor([False] * 3 + [True] + [False] * 4))


def collected_batch(model, tok, monkeypatch):
    """collect_batch on PROMPTS, its rollout returning COMPLETIONS: prompts, rewards and advantages are its own."""
    def fixed_rollout(policy, prompt_ids, prompt_mask, tokenizer, **kwargs):
        rows = [tok(text, add_special_tokens=False).input_ids for text in COMPLETIONS]
        ids = torch.tensor([r + [tok.eos_token_id] * (6 - len(r)) for r in rows])   # generate pads with EOS
        mask, truncated = tg.completion_mask(ids, tok.eos_token_id)
        return ids, mask, truncated
    monkeypatch.setattr(tg, "rollout", fixed_rollout)
    run = make_run(model, tok, reward_fns=[tg.reverse_reward], weights=[1.0])
    return tg.collect_batch(tg.parse_args(FLAGS), run, PROMPTS)


def train_and_record_gradient(model, tok, batch):
    """train_on_batch on a copy of the model: the gradient its optimizer received, and the step's record as
    step_metrics makes it from the batch and the update's losses."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    received = []
    optimizer.register_step_pre_hook(lambda opt, *_: received.append([p.grad.clone() for p in model.parameters()]))
    run = make_run(model, tok, optimizer)
    state = tg.TrainState()
    losses = tg.train_on_batch(tg.parse_args(FLAGS), run, batch, state)
    record = tg.step_metrics(tg.parse_args(FLAGS), run, batch, state, losses, step_time=1.0)
    return received[0], record


def test_a_hand_built_batch_trains_as_the_collected_one_and_as_the_formula_says(monkeypatch):
    model, tok = tiny()
    hand = hand_batch(tok)
    collected = collected_batch(model, tok, monkeypatch)
    # The batch that collect_batch hands over is the one built by hand (generate pads after the EOS with EOS).
    for field in ("attention_mask", "completion_mask", "completion_len", "truncated"):
        assert torch.equal(getattr(collected, field), getattr(hand, field)), field
    assert torch.equal(collected.input_ids * collected.attention_mask, hand.input_ids * hand.attention_mask)
    torch.testing.assert_close(collected.rewards, hand.rewards)
    torch.testing.assert_close(collected.advantages, hand.advantages)
    assert collected.old_logps is None and collected.ref_logps is None    # mu = 1, beta = 0
    # The grpo loss on policy by hand: d/dtheta of -sum_i A_i / (|o_i| * B*G) * sum_t m logp, by a plain forward.
    T = 6
    positions = (hand.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(hand.input_ids, attention_mask=hand.attention_mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, -T - 1:-1].double(), -1).gather(-1, hand.input_ids[:, -T:, None]).squeeze(-1)
    m = hand.completion_mask.double()
    per_row = (logp * m).sum(1) / m.sum(1)
    want = torch.autograd.grad(-(hand.advantages.double() * per_row).sum() / 8, list(model.parameters()))
    got_hand, record_hand = train_and_record_gradient(model, tok, hand)
    got_collected, record_collected = train_and_record_gradient(model, tok, collected)
    for g_hand, g_collected, w in zip(got_hand, got_collected, want):
        torch.testing.assert_close(g_hand, w.float(), rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(g_collected, g_hand, rtol=1e-5, atol=1e-8)
    assert record_hand["reward"] == pytest.approx(sum(REWARDS) / 8)
    assert record_hand["truncated_frac"] == 1 / 8 and record_hand["completion_len"] == pytest.approx(42 / 8)   # EOS included
    assert record_hand["loss"] == pytest.approx(record_collected["loss"], rel=1e-6)


def test_a_batch_without_old_logps_clips_its_later_updates_as_with_the_samplers_own(monkeypatch):
    """mu = 2 at a large learning rate: a Batch that leaves old_logps empty trains exactly as one that brings the
    sampling policy's log-probs, computed here by a plain full-logits forward. Taking each update's own fresh
    log-probs as old would keep the ratio at 1, and update 2 would never clip."""
    model, tok = tiny()
    flags = FLAGS + ["--num_iterations", "2", "--learning_rate", "0.05", "--grad_clip", "1"]
    batch = collected_batch(model, tok, monkeypatch)
    T = batch.completion_mask.shape[1]
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, -T - 1:-1].float(), -1).gather(-1, batch.input_ids[:, -T:, None]).squeeze(-1)
    records = []
    for old in (None, logp):
        policy = copy.deepcopy(model)
        args = tg.parse_args(flags)
        optimizer, scheduler = tg.build_optimizer(policy, args)
        run = make_run(policy, tok, optimizer, scheduler=scheduler)
        state = tg.TrainState()
        losses = tg.train_on_batch(args, run, dataclasses.replace(batch, old_logps=old), state)
        records.append(tg.step_metrics(args, run, batch, state, losses, step_time=1.0))
    left_empty, given = records
    assert given["clip_ratio"] > 0                                  # update 2 clips
    assert left_empty["clip_ratio"] == pytest.approx(given["clip_ratio"])
    assert left_empty["policy_loss"] == pytest.approx(given["policy_loss"], rel=1e-4)


def test_main_takes_a_collect_function_and_logs_every_metric_of_its_batch(tmp_path):
    """The README's fork: main(collect=...) runs it at every step, trains on what it returns, and logs every
    metric a plain run logs. Here it zeroes the advantages, so nothing is learned: the loss and its gradient
    are 0 (beta = 0, no bonus), and AdamW leaves the weights where the plain first step moves them."""
    calls = []

    def no_signal(args, run, prompt_rows):
        calls.append(len(prompt_rows))
        batch = tg.collect_batch(args, run, prompt_rows)
        batch.advantages = torch.zeros_like(batch.advantages)
        return batch
    flags = FAST + ["--max_steps", "2"]
    tg.main(flags + ["--save_dir", str(tmp_path / "fork")], collect=no_signal)
    tg.main(flags + ["--save_dir", str(tmp_path / "plain")])
    assert calls == [4, 4]
    fork = [json.loads(line) for line in open(tmp_path / "fork" / "metrics.jsonl")]
    plain = [json.loads(line) for line in open(tmp_path / "plain" / "metrics.jsonl")]
    assert [sorted(r) for r in fork] == [sorted(r) for r in plain]
    assert all(r["advantage_std"] == 0 and r["policy_loss"] == 0 and r["grad_norm"] == 0 for r in fork)
    assert all(r["grad_norm"] > 0 for r in plain)


def test_cli_takes_the_collect_function_too_and_keeps_its_one_line_errors(tmp_path, capsys):
    """The README's fork through cli: the collect function runs at every step, and a bad input stays one line."""
    calls = []

    def counting(args, run, prompt_rows):
        calls.append(len(prompt_rows))
        return tg.collect_batch(args, run, prompt_rows)
    flags = FAST + ["--max_steps", "2", "--save_dir", str(tmp_path)]
    assert tg.cli(flags, collect=counting) == 0 and calls == [4, 4]
    capsys.readouterr()
    assert tg.cli(flags, collect=counting) == 1          # the folder holds that run's checkpoints now
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "--save_dir" in errors[0] and calls == [4, 4]
