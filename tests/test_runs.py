"""A run says what it ran, a fresh start never meets an old run, and --resume continues only that run, with its
flags. Also: the warm-up is not redone for nothing, and the built-in model runs on one thread unless you say."""
import json
import os

import pytest
import torch

from helpers import FAST, tg
from test_cli import in_process, one_line_error
from test_real_path import one_thread  # noqa: F401  (an autouse fixture)

SHORT = [*FAST, "--max_steps", "4"]


def metrics(save_dir):
    return [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"))]


def test_args_json_holds_every_resolved_flag_in_the_save_dir_and_each_checkpoint(tmp_path, capsys):
    tg.main([*SHORT, "--max_steps", "2", "--save_interval", "1", "--entropy_coef", "0.01", "--save_dir", str(tmp_path)])
    saved = json.load(open(tmp_path / "args.json"))
    # Every flag is there, typed or not: the typed ones as typed, the rest at the toy's defaults; and the world size.
    assert sorted(saved) == sorted([f.name for f in tg.dataclasses.fields(tg.Args)] + ["world_size"])
    assert saved["world_size"] == 1
    assert saved["entropy_coef"] == 0.01 and saved["max_steps"] == 2 and saved["batch_size"] == 4
    assert saved["learning_rate"] == 2e-4 and saved["loss_type"] == "grpo" and saved["epsilon_high"] == 0.2
    for step in (1, 2):
        assert json.load(open(tmp_path / f"checkpoint-{step}" / "args.json")) == saved
    out = capsys.readouterr().out
    assert "--entropy_coef 0.01" in out and "--max_steps 2" in out and "--learning_rate" not in out


def test_help_says_where_a_real_model_and_a_task_bring_their_own_defaults(capsys):
    res = in_process(capsys, "--help")
    text = " ".join(res.stdout.split())
    assert res.returncode == 0 and "bring their own" in text and "args.json" in text


def test_a_fresh_start_in_a_folder_with_checkpoints_stops_and_deletes_nothing(tmp_path, capsys):
    tg.main([*SHORT, "--max_steps", "2", "--save_interval", "1", "--seed", "1", "--save_dir", str(tmp_path)])
    before = {name: os.path.getmtime(tmp_path / name) for name in os.listdir(tmp_path)}
    log = open(tmp_path / "metrics.jsonl").read()
    line = one_line_error(in_process(capsys, *SHORT, "--learning_rate", "1e-5", "--save_dir", tmp_path))
    assert "--resume auto" in line and "--save_dir" in line
    assert {name: os.path.getmtime(tmp_path / name) for name in os.listdir(tmp_path)} == before
    assert open(tmp_path / "metrics.jsonl").read() == log


@pytest.mark.parametrize("flag, value, saved", [("--entropy_coef", "0.0", "0.05"), ("--learning_rate", "1e-05", "0.0002"),
                                                ("--weight_decay", "0.1", "0.0"), ("--loss_type", "dapo", "grpo")])
def test_a_flag_that_changes_what_is_computed_stops_a_resume_naming_both_values(tmp_path, capsys, flag, value,
                                                                                 saved):
    tg.main([*SHORT, "--entropy_coef", "0.05", "--stop_after", "2", "--save_dir", str(tmp_path)])
    line = one_line_error(in_process(capsys, *SHORT, "--entropy_coef", "0.05", flag, value, "--resume", "auto",
                                     "--save_dir", tmp_path))
    assert f"{flag} {value} differs from {saved}" in line
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


def test_a_resume_takes_its_runs_flags_and_applies_how_long_and_how_often(tmp_path):
    """Stopped after step 2 with a bonus of 0.05 and a KL term. Resumed with no flag but --max_steps 5 and
    --save_interval 1: steps 3-5 still apply 0.05, the KL and the run's lr, and the new length and checkpoints
    apply."""
    tg.main([*SHORT, "--entropy_coef", "0.05", "--beta", "0.04", "--learning_rate", "1e-3", "--stop_after", "2",
             "--save_dir", str(tmp_path)])
    tg.main(["--max_steps", "5", "--save_interval", "1", "--resume", "auto", "--save_dir", str(tmp_path)])
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["entropy_coef_applied"] for r in rows] == [0.05] * 5
    assert [r["learning_rate"] for r in rows] == [1e-3] * 5
    assert all(r["kl"] > 0 for r in rows[1:])        # beta is the run's, though not typed at the resume
    assert all((tmp_path / f"checkpoint-{step}").is_dir() for step in (3, 4, 5))
    assert json.load(open(tmp_path / "args.json"))["max_steps"] == 5


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_a_resume_redoes_the_warm_up_only_to_rebuild_the_reference(tmp_path, monkeypatch, beta):
    """With beta = 0 the checkpoint holds everything, and the warm-up would be overwritten; with beta > 0 the
    reference is the policy as the warm-up left it. Both end with the straight run's weights."""
    calls = []
    real = tg.sft_warmup
    monkeypatch.setattr(tg, "sft_warmup", lambda *a: calls.append(1) or real(*a))
    common = [*SHORT, "--sft_warmup_steps", "5", "--beta", str(beta)]
    tg.main([*common, "--save_dir", str(tmp_path / "a")])
    tg.main([*common, "--stop_after", "2", "--save_dir", str(tmp_path / "b")])
    calls.clear()
    tg.main([*common, "--resume", "auto", "--save_dir", str(tmp_path / "b")])
    assert len(calls) == (1 if beta > 0 else 0)
    from safetensors.torch import load_file
    wa = load_file(tmp_path / "a" / "final" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_built_in_model_runs_on_one_thread_unless_you_set_a_count(tmp_path, monkeypatch):
    """main runs the built-in model on one thread unless OMP_NUM_THREADS is set, leaves a real model's count as the
    caller's, and gives the caller its count back after, an error too."""
    seen = []

    def train(*a):
        seen.append(torch.get_num_threads())
        if len(seen) == 4:
            raise RuntimeError("killed")
    monkeypatch.setattr(tg, "train", train)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    outside = torch.get_num_threads()
    try:
        torch.set_num_threads(2)                               # this module's fixture holds one: the caller's two
        tg.main([*SHORT, "--save_dir", str(tmp_path)])
        assert seen[-1] == 1 and torch.get_num_threads() == 2   # one thread, and the caller's count back after
        # a real model: the caller's count (train is a stand-in here, so nothing loads)
        tg.main(["--model_name_or_path", "X", "--dataset", "gsm8k", "--save_dir", str(tmp_path)])
        assert seen[-1] == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")             # a count set in the environment
        tg.main([*SHORT, "--save_dir", str(tmp_path)])
        assert seen[-1] == 2 and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        with pytest.raises(RuntimeError, match="killed"):
            tg.main([*SHORT, "--save_dir", str(tmp_path)])
        assert seen == [1, 2, 2, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outside)


def test_peak_memory_reads_ru_maxrss_in_the_units_of_the_platform(monkeypatch):
    import resource
    monkeypatch.setattr(resource, "getrusage", lambda who: type("Usage", (), {"ru_maxrss": 3 * 2**30})())
    monkeypatch.setattr(tg.sys, "platform", "darwin")          # bytes
    assert tg.peak_memory_gib("cpu") == 3.0
    monkeypatch.setattr(tg.sys, "platform", "linux")           # KiB
    assert tg.peak_memory_gib("cpu") == 3.0 * 2**10


def test_prompts_follow_the_samplers_permutation_epoch_after_epoch():
    """DistributedSampler's order, by hand: randperm seeded with seed + epoch, every world-th index from rank."""
    rows = list(range(10))
    sampler = tg.DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
    state = tg.TrainState()
    got = [tg.next_prompts(sampler, rows, state, 2) for _ in range(6)]
    want = []
    for epoch in range(3):
        g = torch.Generator()
        g.manual_seed(3 + epoch)
        mine = torch.randperm(10, generator=g).tolist()[1::2]
        want += [mine[0:2], mine[2:4]]   # 5 rows per rank: two batches of 2, the fifth waits for no one
    assert got == want


# ---- a row's weight never depends on the micro-batch it lands in ----
def plain_logps(model, input_ids, attn, T):
    """log p of each completion token by a plain full-logits forward, [rows, T], in float64."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    z = model(input_ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1].double()
    return torch.log_softmax(z, -1).gather(-1, input_ids[:, -T:, None]).squeeze(-1)


def test_bnpo_weighs_every_row_alike_when_the_last_micro_batch_is_shorter():
    """12 rows of equal length in micro-batches of 8 and 4. Each micro-batch's token mean weighs its share of the
    rows, so the step's gradient is that of one token mean over all 12 rows; 1/S would count rows 9-12 twice."""
    from helpers import make_run, sample_batch, step_on_batch, tiny
    model, tok = tiny()
    input_ids, attn, comp, mask = sample_batch(model, tok, n_prompts=3, G=4)
    T = comp.shape[1]
    mask = torch.ones_like(mask)                                      # every row holds T tokens
    attn = torch.cat([attn[:, :-T], mask], 1)
    advantages = torch.linspace(-1.5, 1.0, 12)
    logp = plain_logps(model, input_ids, attn, T)
    want = torch.autograd.grad(-(advantages[:, None].double() * logp).sum() / (12 * T), list(model.parameters()))
    args = tg.parse_args(["--loss_type", "bnpo", "--batch_size", "3", "--num_generations", "4",
                          "--micro_batch_size", "8", "--grad_clip", "0"])
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = dict(input_ids=input_ids, attention_mask=attn, mask=mask, advantages=advantages)
    _, received = step_on_batch(args, run, batch)
    for got, w in zip(received[0], want):
        torch.testing.assert_close(got, w.float(), rtol=1e-4, atol=1e-7)


def test_moe_router_loss_weighs_each_micro_batch_by_its_share_of_the_rows():
    """The logged aux_loss and the loss (all advantages 0) against plain forwards of each micro-batch: the
    router loss of rows 1-8 weighs 8/12, of rows 9-12 4/12."""
    from helpers import make_run, sample_batch, step_on_batch, tiny
    model, tok = tiny(use_moe=1)
    input_ids, attn, comp, mask = sample_batch(model, tok, n_prompts=3, G=4)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    aux = []
    with torch.no_grad():
        for part in (slice(0, 8), slice(8, 12)):
            out = model(input_ids[part], attention_mask=attn[part], position_ids=pos[part], output_router_logits=True)
            aux.append(out.aux_loss.item())
    assert abs(aux[0] - aux[1]) > 1e-4                     # the weights matter
    want = 8 / 12 * aux[0] + 4 / 12 * aux[1]
    args = tg.parse_args(["--use_moe", "1", "--batch_size", "3", "--num_generations", "4", "--micro_batch_size", "8",
                          "--share_prompt", "0"])  # the plain path's router loss: each row its whole prompt
    run = make_run(model, tok, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = dict(input_ids=input_ids, attention_mask=attn, mask=mask, advantages=torch.zeros(12))
    record, _ = step_on_batch(args, run, batch)
    assert record["aux_loss"] == pytest.approx(want, rel=1e-5)
    assert record["loss"] == pytest.approx(model.config.router_aux_loss_coef * want, rel=1e-5)


# ---- a dataset the built-in rewards cannot score ----
def test_a_dataset_that_is_not_built_in_needs_your_rewards_even_if_its_rows_are_gsm8ks(tmp_path):
    """Only compare_numbers and gsm8k (and the reversal task) bring their rewards: any other dataset, a file of
    GSM8K's own rows included, stops in one line once its file loads, naming GSM8K's rewards for you to give."""
    from test_real_path import SAMPLE
    rows = [{"prompt": f"Name a colour #{i}", "answer": "red"} for i in range(40)]
    path = tmp_path / "colours.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for dataset in (str(path), SAMPLE):
        args = tg.parse_args(["--model_name_or_path", "X", "--dataset", dataset, "--batch_size", "2",
                              "--eval_size", "4"])
        with pytest.raises(tg.TrainerError) as e:
            tg.load_task(args, 1)
        assert str(e.value) == (f"--dataset {dataset} is not a built-in task: give its rewards with --reward_funcs "
                                f"(GSM8K's: --reward_funcs gsm8k_correct_reward,gsm8k_format_reward "
                                f"--reward_weights 1,0.1)")
    gsm8k = tg.parse_args(["--model_name_or_path", "X", "--dataset", SAMPLE, "--batch_size", "2", "--eval_size", "4",
                           "--reward_funcs", "gsm8k_correct_reward,gsm8k_format_reward"])
    *_, fns, weights, key = tg.load_task(gsm8k, 1)
    # the functions you name, each of weight 1, and the held-out score is their weighted sum
    assert fns == [tg.gsm8k_correct_reward, tg.gsm8k_format_reward] and weights == [1.0, 1.0]
    assert key == "eval_reward"
    mine = tg.parse_args(["--model_name_or_path", "X", "--dataset", str(path), "--eval_size", "4",
                          "--reward_funcs", "gsm8k_format_reward"])
    assert tg.load_task(mine, 1)[2] == [tg.gsm8k_format_reward]


def test_gpu_runs_of_a_real_model_checkpoint_their_layers_cpu_runs_do_not(monkeypatch):
    real = ["--model_name_or_path", "X", "--dataset", "gsm8k"]
    assert tg.parse_args(real).gradient_checkpointing == 0
    monkeypatch.setattr(tg.torch.cuda, "is_available", lambda: True)
    assert tg.parse_args(real).gradient_checkpointing == 1
    assert tg.parse_args([*real, "--device", "cpu"]).gradient_checkpointing == 0
    assert tg.parse_args([*real, "--gradient_checkpointing", "0"]).gradient_checkpointing == 0
    assert tg.parse_args([]).gradient_checkpointing == 0      # the toy never


def test_a_cosine_run_keeps_its_length_at_a_resume_and_a_typed_minus_one_reads_as_epsilon(tmp_path, capsys):
    """Under a cosine schedule --max_steps sets every step's learning rate, so it may not change at a resume.
    epsilon_high's -1 stands for epsilon: typed at a resume, it is the run's own value, not a change."""
    tg.main([*SHORT, "--lr_scheduler", "cosine", "--stop_after", "2", "--save_dir", str(tmp_path)])
    line = one_line_error(in_process(capsys, "--max_steps", "8", "--resume", "auto", "--save_dir", tmp_path))
    assert "--max_steps 8 differs from 4" in line
    tg.main(["--epsilon_high", "-1", "--resume", "auto", "--save_dir", str(tmp_path)])
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_resume_of_a_checkpoint_folder_continues_in_that_folder_never_in_another_runs(tmp_path, capsys):
    """--resume <checkpoint> without --save_dir goes on where the checkpoint lies; into a folder that holds another
    run it stops, and changes nothing there."""
    tg.main([*SHORT, "--seed", "5", "--save_interval", "1", "--save_dir", str(tmp_path / "other")])
    tg.main([*SHORT, "--stop_after", "2", "--save_dir", str(tmp_path / "a")])
    before = open(tmp_path / "other" / "metrics.jsonl").read()
    line = one_line_error(in_process(capsys, "--resume", tmp_path / "a" / "checkpoint-2",
                                     "--save_dir", tmp_path / "other"))
    assert line == (f"error: --save_dir {tmp_path / 'other'} holds an earlier run: continue it with --resume auto, "
                    f"or give another --save_dir")
    assert open(tmp_path / "other" / "metrics.jsonl").read() == before
    tg.main(["--resume", str(tmp_path / "a" / "checkpoint-2")])
    assert [r["step"] for r in metrics(tmp_path / "a")] == [1, 2, 3, 4]
    assert (tmp_path / "a" / "final").is_dir() and not os.path.exists("runs")
