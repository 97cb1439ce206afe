"""Every flag is checked before any work: one line `error: ...` naming the flag, a non-zero exit, no traceback,
and nothing written to --save_dir."""
import os

import pytest
import torch

from helpers import ROOT, run_cli, tg

SAMPLE = os.path.join(ROOT, "tests", "data", "gsm8k_sample.jsonl")


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
    (["--top_p", "0"], "--top_p"),
    (["--top_p", "1.5"], "--top_p"),
    (["--top_k", "-1"], "--top_k"),
    (["--beta", "-0.04"], "--beta"),
    (["--entropy_coef_min", "0.01", "--entropy_coef_max", "0.001"], "--entropy_coef_min"),
    (["--entropy_coef_delta=-1e-4"], "--entropy_coef_delta must be >= 0"),
    (["--entropy_coef", "inf"], "--entropy_coef"),
    (["--reward_weights", "a,b"], "--reward_weights"),
    (["--reward_weights", "1,0.1"], "--reward_weights"),  # the built-in task has one reward function
    (["--micro_batch_size", "3"], "--micro_batch_size"),
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
    (["--model_name_or_path", model_dir_without_weights, "--dataset", SAMPLE], "no model weights"),
    (["--model_name_or_path", "./no/such/model", "--dataset", SAMPLE], "no such directory"),
    (["--model_name_or_path", model_dir_with_broken_weights, "--dataset", SAMPLE], "--model_name_or_path"),
    (["--model_name_or_path", model_dir_without_weights], "--dataset"),
    (["--dataset", a_directory], "--dataset"),
    (["--dataset", "missing.jsonl"], "--dataset"),
    (["--save_dir", a_file], "--save_dir"),
    (["--resume", "no/such/checkpoint"], "--resume"),
    (["--reward_funcs", "no_such_rewards.py:f"], "--reward_funcs"),
    (["--micro_batch_tokens", "0"], "--micro_batch_tokens"),
    (["--rollout_cache", "paged"], "--rollout_cache"),
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


@pytest.mark.parametrize("argv, flag", [(["--top_p", "2"], "--top_p"), (["--dataset", "missing.jsonl"], "--dataset")])
def test_the_real_command_line_says_the_same(tmp_path, argv, flag):
    res = run_cli(*argv, "--save_dir", tmp_path / "run")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert [l for l in res.stderr.splitlines() if l.startswith("error:")] == [l for l in res.stderr.splitlines()
                                                                               if l.strip()]
    assert flag in res.stderr and not (tmp_path / "run").exists()


def test_help_shows_every_flag_with_its_default_under_its_group():
    """--help lists each Args field under the group its comment in Args names, with its default."""
    import dataclasses
    import re
    groups, group_of = [], {}
    import inspect
    for line in inspect.getsource(tg.Args).split("\n"):                  # the class's own lines
        if re.fullmatch(r"    # .+", line):
            groups.append(line.strip()[2:])
        elif re.match(r"    \w+: ", line):
            group_of[line.split(":")[0].strip()] = groups[-1]
    text = tg.build_parser().format_help()
    starts = {g: text.index(f"\n{g}:\n") for g in groups}
    assert list(starts.values()) == sorted(starts.values())            # the groups in Args' order
    bounds = dict(zip(groups, [*list(starts.values())[1:], len(text)]))
    for f in dataclasses.fields(tg.Args):
        at = text.index(f"\n  --{f.name} ")
        g = group_of[f.name]
        assert starts[g] < at < bounds[g], f"--{f.name} is not under '{g}'"
        entry = " ".join(text[at:].split("\n  --")[1].split("\n\n")[0].split())  # this flag's lines
        assert entry.endswith(f"(default: {f.default!r})"), entry


def test_an_args_built_in_code_gets_the_epsilon_high_rule_too():
    """-1 is a sentinel: an Args built without parse_args (a test, a notebook, a fork) must not clip at 1 + (-1)."""
    assert tg.Args().epsilon_high == 0.2 and tg.Args(epsilon=0.3).epsilon_high == 0.3
    assert tg.Args(loss_type="cispo").epsilon_high == 5.0 and tg.Args(epsilon_high=0.28).epsilon_high == 0.28
