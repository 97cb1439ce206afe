"""No work without a gradient (#26): rows whose advantage is 0 skip the log-prob forwards and the backward,
and the update is the one without skipping (README: Work without a gradient)."""
import json
import math
import os

import pytest
import torch

import helpers
from helpers import tg, tiny

# a reward that most groups of the untrained tiny model tie on (about 1 completion in 11 starts with "a")
REWARD = "def first_is_a(completion):\n    return float(completion[:1] == 'a')\n" \
         "def always_one(completion):\n    return 1.0\n"
BASE = ["--batch_size", "4", "--num_generations", "4", "--max_gen_len", "6", "--sft_warmup_steps", "0",
        "--eval_interval", "0", "--learning_rate", "1e-2", "--grad_clip", "0"]


def reward_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARD)
    return str(path)


def run(tmp_path, name, skip, *extra, reward="first_is_a"):
    """tg.main for a few steps; the final weights, the logged records, and how many rows each graph forward
    of the loss held (completion_logps with grad on)."""
    forwards, real = [], tg.completion_logps

    def counting(model, input_ids, *a, **k):
        if torch.is_grad_enabled():
            forwards.append(input_ids.shape[0])
        return real(model, input_ids, *a, **k)
    tg.completion_logps = counting
    try:
        res = tg.main([*BASE, "--reward_funcs", f"{reward_file(tmp_path)}:{reward}", "--skip_zero_advantage_rows",
                       str(skip), "--save_dir", str(tmp_path / name), *map(str, extra)])
    finally:
        tg.completion_logps = real
    records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    return res["model"].state_dict(), records, forwards


def assert_same_update(on, off):
    for k in off[0]:
        torch.testing.assert_close(on[0][k], off[0][k], rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(on[1], off[1]):  # the gradient and the loss of every step, before AdamW hides a scale
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("loss_type, extra", [
    ("grpo", ()), ("dr_grpo", ()), ("dapo", ()), ("cispo", ()),
    ("grpo", ("--micro_batch_size", "4")),                       # kept rows regrouped over fewer micro-steps
    ("dr_grpo", ("--num_iterations", "2", "--micro_batch_size", "8")),   # old log-probs of the kept rows only
    # with the other options that touch the loss: GSPO, truncated completions masked, mu = 2; top_p, batch std.
    # (lr 1e-4: AdamW's first step, lr * g / (|g| + eps), makes the float-order noise of a gradient near 0,
    # ~1e-12, a move of lr * 1e-4, which the second update's gradient then carries: at 1e-2, above atol)
    ("grpo", ("--importance_sampling_level", "sequence", "--mask_truncated_completions", "1",
              "--num_iterations", "2", "--max_gen_len", "3", "--learning_rate", "1e-4")),
    ("dapo", ("--top_p", "0.9", "--scale_rewards", "batch")),
])
def test_skipping_gives_the_update_without_skipping(tmp_path, loss_type, extra):
    flags = ["--loss_type", loss_type, "--max_steps", "4", *extra]
    on, off = run(tmp_path, "on", 1, *flags), run(tmp_path, "off", 0, *flags)
    rows = 16
    trained = [r["rows_trained"] for r in on[1]]
    assert all(r["rows_trained"] == rows for r in off[1])
    assert any(0 < t < rows for t in trained), trained         # some rows skipped, some trained
    assert [r["frac_reward_zero_std"] for r in on[1]] == [r["frac_reward_zero_std"] for r in off[1]]
    # the graph forwards held only the trained rows (each step: mu passes over them)
    mu = 2 if "--num_iterations" in extra else 1
    assert sum(on[2]) == mu * sum(trained) and sum(off[2]) == mu * rows * len(trained)
    if "--mask_truncated_completions" in extra:  # rows without a masked token are skipped too
        assert all(not math.isinf(r.get("is_ratio_max", 0.0)) for r in on[1])
    assert_same_update(on, off)


def test_skipping_is_off_where_a_zero_advantage_row_has_a_gradient(tmp_path):
    for flags in (["--beta", "0.1"], ["--entropy_coef", "0.01"], ["--use_adaptive_entropy", "1"],
                  ["--use_moe", "1"], ["--loss_type", "bnpo"]):
        _, records, _ = run(tmp_path, "x", 1, "--max_steps", "1", *flags)
        assert records[0]["rows_trained"] == 16, flags
        assert records[0]["frac_reward_zero_std"] > 0, flags   # there were rows to skip


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_step_where_every_group_ties_trains_nothing_and_adamw_steps_on_zero_gradients(tmp_path, dtype):
    """fp16: the step still goes through the loss scaler, whose first use creates its scale, in a fresh run
    and in a resumed process's first update alike; with or without skipping, the same run."""
    wd, lr, steps = 0.5, 1e-2, 2
    flags = ["--max_steps", steps, "--weight_decay", wd, "--learning_rate", lr, "--warmup_steps", 1,
             "--dtype", dtype]
    on = run(tmp_path, "on", 1, *flags, reward="always_one")
    off = run(tmp_path, "off", 0, *flags, reward="always_one")
    run(tmp_path, "cut", 1, *flags, "--stop_after", 1, reward="always_one")
    cut = run(tmp_path, "cut", 1, *flags, "--resume", "auto", reward="always_one")
    assert on[2] == [] == cut[2] and len(off[2]) == steps       # no forward with a graph at all
    assert all(r["rows_trained"] == 0 and "entropy" not in r and r["grad_norm"] == 0 for r in on[1] + cut[1])
    # every metric the skipping run logs, the others log alike (entropy, clip ratio, mismatch: of trained tokens)
    vary = {"rows_trained", "step_time", "generate_time", "generate_share", "tokens_per_s", "peak_mem_gib"}
    assert ("loss_scale" in on[1][0]) == (dtype == "float16") and len(on[1]) == len(cut[1]) == steps
    for a, b, c in zip(on[1], off[1], cut[1]):
        assert {k: v for k, v in a.items() if k not in vary} == {k: b[k] for k in a if k not in vary} \
            == {k: c[k] for k in a if k not in vary}
    # independent: AdamW on zero gradients moves each weight by weight decay alone, p <- p (1 - lr_k wd),
    # and the schedule advances: warm-up lr / 2, then lr
    torch.manual_seed(0)
    start = tiny(seed=0)[0].state_dict()
    for k in start:
        want = start[k] * (1 - lr / 2 * wd) * (1 - lr * wd)
        torch.testing.assert_close(on[0][k], want, msg=k)
        assert torch.equal(off[0][k], on[0][k]) and torch.equal(cut[0][k], on[0][k]), k


# ---- two ranks ----
def two_ranks(rank, world, out_dir, skip, reward_path, reward, extra):
    """One run of the trainer on this rank (different prompts per rank); saves the weights, the kept rows of
    each step on this rank and the number of forwards with a graph."""
    kept, forwards = [], [0]
    real_rows, real_logps = tg.rows_to_train, tg.completion_logps

    def rows_to_train(*a, **k):
        out = real_rows(*a, **k)
        kept.append(len(out))
        return out

    def logps(*a, **k):
        forwards[0] += torch.is_grad_enabled()
        return real_logps(*a, **k)
    full, real_finish = {}, tg.finish

    def finish(args, policy, *a, **k):  # every rank calls it while the group is up: gather the weights
        full.update(tg.full_state_dict(policy, every_rank=True))
        return real_finish(args, policy, *a, **k)
    tg.rows_to_train, tg.completion_logps, tg.finish = rows_to_train, logps, finish
    tg.main([*BASE, "--reward_funcs", f"{reward_path}:{reward}", "--skip_zero_advantage_rows", str(skip),
                   "--save_dir", os.path.join(out_dir, f"run{skip}"), *extra])
    torch.save({"params": {k: v.clone() for k, v in full.items()}, "kept": kept,
                "forwards": forwards[0]}, os.path.join(out_dir, f"skip{skip}_rank{rank}.pt"))


@pytest.mark.parametrize("fsdp", [0, 1])
def test_two_ranks_skipping_different_rows_match_the_run_without_skipping(tmp_path, fsdp):
    extra = ["--max_steps", "5", "--batch_size", "2", "--micro_batch_size", "4", "--loss_type", "dapo",
             "--num_iterations", "2", "--fsdp", str(fsdp)]
    for skip in (1, 0):
        helpers.spawn(two_ranks, str(tmp_path), skip, reward_file(tmp_path), "first_is_a", extra, timeout=240)
    on = [torch.load(tmp_path / f"skip1_rank{r}.pt", weights_only=True) for r in (0, 1)]
    off = [torch.load(tmp_path / f"skip0_rank{r}.pt", weights_only=True) for r in (0, 1)]
    k0, k1 = on[0]["kept"], on[1]["kept"]
    assert any(a != b for a, b in zip(k0, k1)), (k0, k1)                      # uneven ranks
    assert any((a == 0) != (b == 0) for a, b in zip(k0, k1)), (k0, k1)        # one rank out of rows: a stand-in
    assert off[0]["kept"] == off[1]["kept"] == [8] * 5                       # 5 steps
    assert on[0]["forwards"] == on[1]["forwards"] < off[0]["forwards"]        # the same count on both ranks
    for k in off[0]["params"]:
        torch.testing.assert_close(on[0]["params"][k], off[0]["params"][k], rtol=1e-5, atol=1e-6, msg=k)
        assert torch.equal(on[0]["params"][k], on[1]["params"][k]), k


def test_two_ranks_where_every_group_ties_train_nothing_and_do_not_hang(tmp_path):
    extra = ["--max_steps", "2", "--batch_size", "2", "--weight_decay", "0.5"]
    helpers.spawn(two_ranks, str(tmp_path), 1, reward_file(tmp_path), "always_one", extra, timeout=240)
    out = [torch.load(tmp_path / f"skip1_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert out[0]["kept"] == out[1]["kept"] == [0, 0] and out[0]["forwards"] == out[1]["forwards"] == 0
    start = tiny(seed=0)[0].state_dict()
    for k in start:  # AdamW on zero gradients: weight decay alone, on both ranks alike
        torch.testing.assert_close(out[0]["params"][k], start[k] * (1 - 1e-2 * 0.5) ** 2, msg=k)
        assert torch.equal(out[0]["params"][k], out[1]["params"][k])


def test_the_entropy_bonus_this_step_applies_decides_not_the_flag():
    """A resumed run carries its coefficient in the checkpoint whatever --entropy_coef now says: skipping
    follows the alpha the loss applies."""
    args = tg.parse_args([])
    advantages, mask = torch.tensor([0.0, 1.0, 0.0, -1.0]), torch.ones(4, 3)
    model, _ = tiny()
    run = tg.Trainer(model, None, None, None, None, None, [], [])
    assert tg.rows_to_train(args, run, advantages, mask, 0.0).tolist() == [1, 3]
    assert tg.rows_to_train(args, run, advantages, mask, 0.05).tolist() == [0, 1, 2, 3]
    mask[1] = 0                                                   # no masked token: nothing to train either
    assert tg.rows_to_train(args, run, advantages, mask, 0.0).tolist() == [3]
