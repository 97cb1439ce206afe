"""Every flag is checked before any work: one line `error: ...` naming the flag, a non-zero exit, no traceback,
and nothing written to --save_dir."""
import os

import pytest
import torch

from helpers import ROOT, run_clis, tg
from test_real_path import one_thread  # noqa: F401  (an autouse fixture)

SAMPLE = os.path.join(ROOT, "tests", "data", "gsm8k_sample.jsonl")
# a file of GSM8K's rows is no built-in task: its rewards are named, so that the model's own problem is the one left
GSM8K = [SAMPLE, "--reward_funcs", "gsm8k_correct_reward,gsm8k_format_reward"]


def model_dir_without_weights(tmp_path):
    d = tmp_path / "no_weights"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    return d


def model_dir_with_broken_weights(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    return d


def a_directory(tmp_path):
    d = tmp_path / "data_dir"
    d.mkdir()
    return d


def a_file(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    return f


# (flags, the word the one error line must contain); a callable builds a path under tmp_path
BAD = [
    (["--learning_rate=-1e-6"], "--learning_rate must be > 0"),  # '=': argparse reads -1e-6 as a flag otherwise
    (["--learning_rate", "0"], "--learning_rate"),
    (["--learning_rate", "nan"], "--learning_rate"),
    (["--sft_learning_rate=-1"], "--sft_learning_rate must be > 0"),
    (["--temperature", "0"], "--temperature"),
    (["--epsilon", "-0.1"], "--epsilon"),
    (["--epsilon", "1.0"], "--epsilon"),
    (["--epsilon_high", "-0.5"], "--epsilon_high"),
    (["--beta", "-0.04"], "--beta"),
    (["--entropy_coef_min", "0.01", "--entropy_coef_max", "0.001"], "--entropy_coef_min"),
    (["--entropy_coef_delta=-1e-4"], "--entropy_coef_delta must be >= 0"),
    (["--entropy_coef", "inf"], "--entropy_coef"),
    (["--reward_weights", "a,b"], "--reward_weights"),
    (["--reward_weights", "1,0.1"], "--reward_weights"),  # the built-in task has one reward function
    (["--micro_batch_size=-1"], "--micro_batch_size must be >= 0"),
    (["--sft_batch_size", "0"], "--sft_batch_size must be > 0"),
    (["--num_completions_to_print=-1"], "--num_completions_to_print must be >= 0"),
    (["--save_total_limit=-1"], "--save_total_limit must be >= 0"),
    (["--warmup_steps", "-1"], "--warmup_steps"),
    (["--grad_clip", "-1"], "--grad_clip"),
    (["--max_gen_len", "0"], "--max_gen_len"),
    (["--eval_size", "-5"], "--eval_size"),
    (["--num_generations", "1"], "--num_generations"),
    (["--dtype", "float8"], "--dtype"),
    (["--device", "tpu"], "--device"),
    pytest.param(["--device", "cuda"], "--device cuda",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")),
    (["--loss_type", "ppo"], "--loss_type"),
    (["--model_name_or_path", model_dir_without_weights, "--dataset", *GSM8K], "no file named model.safetensors"),
    (["--model_name_or_path", "./no/such/model", "--dataset", *GSM8K], "no such folder"),
    (["--model_name_or_path", model_dir_with_broken_weights, "--dataset", *GSM8K], "--model_name_or_path"),
    (["--model_name_or_path", model_dir_without_weights], "--dataset"),
    (["--model_name_or_path", model_dir_without_weights, "--dataset", a_directory], "is a folder"),
    (["--model_name_or_path", model_dir_without_weights, "--dataset", "missing.jsonl"], "Unable to find"),
    (["--model_name_or_path", a_directory, "--dataset", *GSM8K], "no config.json"),
    (["--model_name_or_path", "missing.gguf", "--dataset", *GSM8K], "missing.gguf: no such file"),
    (["--model_name_or_path", model_dir_without_weights, "--dataset", SAMPLE], "--reward_funcs"),
    (["--save_dir", a_file], "--save_dir"),
    (["--resume", "no/such/checkpoint"], "--resume"),
    (["--reward_funcs", "no_such_rewards.py:f"], "--reward_funcs"),
    (["--reward_funcs", lambda tmp_path: f"{a_directory(tmp_path)}:f"], "no such file"),
]


@pytest.mark.parametrize("argv, flag", BAD)
def test_bad_flag_is_one_line_before_any_work(tmp_path, capsys, argv, flag):
    argv = [str(a(tmp_path)) if callable(a) else a for a in argv]
    if "--save_dir" not in argv:
        argv += ["--save_dir", str(tmp_path / "run")]
    try:
        status = tg.cli(argv)   # the same function `python train_grpo.py` runs; an exception fails the test
    except SystemExit as e:  # the argument parser exits with status 2
        status = e.code
    err = capsys.readouterr().err
    assert status not in (0, None)
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and flag in lines[0], err[-2000:]
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_the_real_command_line_says_the_same(tmp_path):
    # a value the parser refuses and a flag check_args refuses, each in its own `python train_grpo.py`
    cases = [(["--epsilon", "1.0"], "--epsilon"), (["--dataset", "missing.jsonl"], "--dataset")]
    runs = run_clis(*([*argv, "--save_dir", tmp_path / f"run{i}"] for i, (argv, _) in enumerate(cases)))
    for i, (res, (_, flag)) in enumerate(zip(runs, cases)):
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert [l for l in res.stderr.splitlines() if l.startswith("error:")] == [l for l in res.stderr.splitlines()
                                                                                   if l.strip()]
        assert flag in res.stderr and not (tmp_path / f"run{i}").exists()


def test_an_args_built_in_code_gets_the_epsilon_high_rule_too():
    """-1 is a sentinel: an Args built without parse_args (a test, a notebook, a fork) must not clip at 1 + (-1)."""
    assert tg.Args().epsilon_high == 0.2 and tg.Args(epsilon=0.3).epsilon_high == 0.3
    assert tg.Args(loss_type="cispo").epsilon_high == 5.0 and tg.Args(epsilon_high=0.28).epsilon_high == 0.28


def test_a_real_model_starts_from_real_sizes_a_task_from_its_own_and_a_typed_flag_wins():
    """--model_name_or_path never trains with the toy's 8 new tokens at lr 2e-4; compare_numbers' own sizes win
    over a real model's; a flag typed on the command line wins over both."""
    sizes = lambda a: dict(batch_size=a.batch_size, micro_batch_size=a.micro_batch_size, max_prompt_len=a.max_prompt_len,
                           max_gen_len=a.max_gen_len, learning_rate=a.learning_rate, max_steps=a.max_steps,
                           eval_interval=a.eval_interval, eval_size=a.eval_size,
                           gradient_checkpointing=a.gradient_checkpointing, num_generations=a.num_generations,
                           save_interval=a.save_interval, save_total_limit=a.save_total_limit)
    toy = sizes(tg.parse_args([]))
    assert toy == dict(batch_size=16, micro_batch_size=0, max_prompt_len=256, max_gen_len=8, learning_rate=2e-4,
                       max_steps=200, eval_interval=50, eval_size=256, gradient_checkpointing=0, num_generations=8,
                       save_interval=0, save_total_limit=0)
    # the README's real-model defaults, by hand; what they do not name keeps Args' default. A real run saves every
    # 50 steps and keeps the newest 2, so that a kill costs at most 50 steps
    real = dict(toy, batch_size=8, micro_batch_size=8, max_prompt_len=512, max_gen_len=512, learning_rate=1e-6,
                max_steps=500, eval_interval=50, gradient_checkpointing=0,  # on a GPU 1: see test_runs
                save_interval=50, save_total_limit=2)
    for dataset in ("gsm8k", SAMPLE):                       # a hub name or a .jsonl of your own
        assert sizes(tg.parse_args(["--model_name_or_path", "X", "--dataset", dataset])) == real, dataset
    compare = dict(real, batch_size=4, max_gen_len=8, max_prompt_len=128, learning_rate=2e-5, max_steps=40,
                   eval_interval=10, eval_size=200)
    assert sizes(tg.parse_args(["--model_name_or_path", "X", "--dataset", "compare_numbers"])) == compare
    # typed flags win: over the task's (max_steps, learning_rate) and over the real model's (micro, checkpointing)
    typed = ["--max_steps", "7", "--learning_rate", "3e-4", "--micro_batch_size", "2", "--gradient_checkpointing", "1"]
    assert sizes(tg.parse_args(["--model_name_or_path", "X", "--dataset", "compare_numbers", *typed])) == dict(
        compare, max_steps=7, learning_rate=3e-4, micro_batch_size=2, gradient_checkpointing=1)
    assert sizes(tg.parse_args(["--model_name_or_path", "X", "--dataset", "gsm8k", "--max_gen_len", "64",
                                "--batch_size", "2"])) == dict(real, max_gen_len=64, batch_size=2)
    assert sizes(tg.parse_args(["--model_name_or_path", "X", "--dataset", "gsm8k", "--save_interval", "0",
                                "--save_total_limit", "0"])) == dict(real, save_interval=0, save_total_limit=0)
