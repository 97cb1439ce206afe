"""A run you can leave alone: a killed run is resumed by --resume auto, never replaced by another run in its folder;
a save clears what a kill left half written; a rule about an MoE reads the model; every log line is strict JSON;
and the console shows what GRPO learns from (a training group), the bar the last eval, the summary the best."""
import importlib.machinery
import json
import os
import re
import subprocess
import sys
import types

import pytest

from helpers import FAST, ROOT, env1, tg
from test_cli import in_process, one_line_error
from test_real_path import TIMING, one_thread  # noqa: F401  (an autouse fixture)
from test_resume import computed, metrics, same_weights


def killed_at_step(n):
    """A collect function that raises as step n starts: steps 1..n-1 are logged, nothing after."""
    calls = [0]

    def collect(args, run, prompt_rows):
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt("killed")
        return tg.collect_batch(args, run, prompt_rows)
    return collect


def test_a_run_killed_before_its_first_checkpoint_is_started_again_by_resume_auto(tmp_path, capsys):
    """A dapo run with beta > 0 and no checkpoint yet, killed at step 3, then only `--resume auto --save_dir`: it
    runs with its own flags (never the toy's grpo with beta 0), its args.json unchanged, and ends as the run that
    never stopped. A checkpoint a kill cut short (checkpoint-N.tmp) is cleared by the next whole save."""
    flags = [*FAST, "--max_steps", "4", "--loss_type", "dapo", "--beta", "0.04", "--log_completions", "1"]
    straight, b = tmp_path / "straight", tmp_path / "b"
    tg.main([*flags, "--save_dir", str(straight)])
    with pytest.raises(KeyboardInterrupt):
        tg.main([*flags, "--save_dir", str(b)], collect=killed_at_step(3))
    assert [r["step"] for r in metrics(b)] == [1, 2] and not list(b.glob("checkpoint-*"))
    flags_file = open(b / "args.json").read()
    (b / "checkpoint-3.tmp").mkdir()                                 # as a kill in the middle of a save leaves it
    (b / "checkpoint-3.tmp" / "model.safetensors").write_text("half")
    capsys.readouterr()
    tg.main(["--resume", "auto", "--save_dir", str(b)])
    assert "holds no whole checkpoint: its run starts again at step 1, with its flags" in capsys.readouterr().out
    assert open(b / "args.json").read() == flags_file
    assert json.loads(flags_file)["loss_type"] == "dapo" and json.loads(flags_file)["beta"] == 0.04
    assert computed(metrics(b)) == computed(metrics(straight))
    assert open(b / "completions.jsonl").read() == open(straight / "completions.jsonl").read()
    assert same_weights(b / "final", straight / "final")
    assert sorted(p.name for p in b.glob("checkpoint-*")) == ["checkpoint-4"]


def test_a_fresh_start_in_a_folder_that_holds_a_run_stops_in_one_line_and_changes_nothing(tmp_path, capsys):
    b = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        tg.main([*FAST, "--max_steps", "4", "--save_dir", str(b)], collect=killed_at_step(3))
    before = {name: open(b / name).read() for name in ("args.json", "metrics.jsonl")}
    line = one_line_error(in_process(capsys, *FAST, "--max_steps", "4", "--save_dir", b))
    assert f"--save_dir {b} holds an earlier run: continue it with --resume auto, or give another --save_dir" in line
    assert {name: open(b / name).read() for name in before} == before
    # A job that always passes --resume auto starts a folder that holds nothing as a fresh run.
    tg.main([*FAST, "--max_steps", "1", "--resume", "auto", "--save_dir", str(tmp_path / "new")])
    assert [r["step"] for r in metrics(tmp_path / "new")] == [1]


def test_a_save_clears_the_half_written_checkpoints_a_kill_left_behind(tmp_path):
    """A kill while checkpoint-1 was written, then a resume that saves at other steps: the .tmp never comes back
    under --save_interval, so the next whole save must remove it."""
    for name in ("checkpoint-1.tmp", "checkpoint-5.deleting"):
        (tmp_path / name).mkdir()
    tg.main([*FAST, "--max_steps", "2", "--save_interval", "2", "--resume", "auto", "--save_dir", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_a_real_model_saves_every_50_steps_and_keeps_the_newest_2():
    args = tg.parse_args(["--model_name_or_path", "someone/model", "--dataset", "gsm8k", "--device", "cpu"])
    assert (args.save_interval, args.save_total_limit) == (50, 2)
    args = tg.parse_args(["--model_name_or_path", "m", "--dataset", "gsm8k", "--save_interval", "7",
                          "--save_total_limit", "0", "--device", "cpu"])
    assert (args.save_interval, args.save_total_limit) == (7, 0)
    assert (tg.parse_args([]).save_interval, tg.parse_args([]).save_total_limit) == (0, 0)


def test_an_moe_loaded_from_a_folder_keeps_its_micro_batch_at_a_resume(tmp_path, capsys):
    """The tiny MoE saved to a folder and trained with --model_name_or_path (args.json: use_moe 0): its router
    loss averages each micro-batch, so a resume must refuse another --micro_batch_size, as for --use_moe 1."""
    tg.main([*FAST, "--max_steps", "1", "--use_moe", "1", "--save_dir", str(tmp_path / "moe")])
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": s + "=", "answer": s[::-1]}) + "\n"
                            for s in ("abcde", "badce", "cabed", "dceab", "edcba", "ghfea", "hgfed", "aabbc")))
    run = tmp_path / "run"
    common = [*FAST, "--model_name_or_path", tmp_path / "moe" / "final", "--dataset", data, "--reward_funcs",
              "reverse_reward", "--max_steps", "3", "--save_dir", run]
    assert tg.cli([str(a) for a in [*common, "--micro_batch_size", "8", "--stop_after", "1"]]) == 0
    assert json.load(open(run / "args.json"))["use_moe"] == 0 and "aux_loss" in metrics(run)[0]
    line = one_line_error(in_process(capsys, "--micro_batch_size", "4", "--resume", "auto", "--save_dir", run))
    assert "--micro_batch_size 4 differs from 8" in line
    assert [r["step"] for r in metrics(run)] == [1]


def test_a_reward_that_scores_no_row_logs_null_never_a_bare_nan(tmp_path):
    """NaN is not JSON: `rewards/g/mean` of a function that returned None on every row is null in metrics.jsonl
    (every test's logs are also read strictly, in conftest.py)."""
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [1.0] * len(completions)\n"
                                   "def g(completions, **kw):\n    return [None] * len(completions)\n")
    tg.main([*FAST, "--max_steps", "1", "--reward_funcs", f"{tmp_path / 'r.py'}:f,{tmp_path / 'r.py'}:g",
             "--save_dir", str(tmp_path / "run")])
    (line,) = open(tmp_path / "run" / "metrics.jsonl").read().splitlines()
    assert '"rewards/g/mean": null' in line and '"rewards/g/std": null' in line and "NaN" not in line
    assert tg.json_line({"a": float("nan"), "b": float("-inf"), "c": 1.5, "d": "x"}) == (
        '{"a": null, "b": null, "c": 1.5, "d": "x"}\n')


def test_the_readme_fork_runs_as_written_after_the_set_up_command(tmp_path):
    """The README's "Fork the step" block, copied verbatim, in a folder where the Set-up command's run has left
    runs/grpo: it trains in its own folder and exits 0."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Fork the step")[1].split("\n## ")[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    (tmp_path / "runs" / "grpo" / "checkpoint-200").mkdir(parents=True)
    (tmp_path / "runs" / "grpo" / "args.json").write_text(json.dumps({"loss_type": "grpo"}))
    (tmp_path / "fork.py").write_text(code)
    env = dict(env1(), PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "fork.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [r["step"] for r in metrics(tmp_path / "runs" / "positive_only")][-1] == 50


def test_each_eval_prints_a_training_group_the_bar_keeps_the_eval_and_the_summary_gives_the_best(tmp_path, capsys,
                                                                                                 monkeypatch):
    postfixes = []

    class Bar(tg.tqdm):
        def set_postfix(self, **kwargs):
            postfixes.append(kwargs)
            super().set_postfix(**kwargs)
    monkeypatch.setattr(tg, "tqdm", Bar)
    capsys.readouterr()
    tg.main([*FAST, "--max_steps", "4", "--eval_interval", "2", "--log_completions", "1", "--save_dir",
             str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    records = metrics(tmp_path)
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    for step in (2, 4):
        train = [r for r in rows if r["step"] == step and r["split"] == "train"]
        groups = [train[i:i + 4] for i in range(0, 16, 4)]
        differing = [g for g in groups if len({r["reward"] for r in g}) > 1]
        group = (differing or groups)[0]
        head = out.index(f"  step {step} training group of {group[0]['prompt']!r}:")
        for i, r in enumerate(group):
            assert out[head + 1 + i] == (f"    {r['completion']!r}: reverse_reward {r['rewards']['reverse_reward']:.3f}"
                                         f", advantage {r['advantage']:+.3f}")
    # the bar shows the last eval on every step, not only on a step that evaluates
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    assert [p["eval"] for p in postfixes] == [f"{evals[0]:.3f}", f"{evals[2]:.3f}", f"{evals[2]:.3f}",
                                              f"{evals[4]:.3f}"]
    best_step = max(evals, key=lambda s: (evals[s], -s))
    summary = [line for line in out if line.startswith("done:")][0]
    assert (f"held-out eval_accuracy {evals[0]:.3f} (step 0), best {evals[best_step]:.3f} (step {best_step}), "
            f"last {evals[4]:.3f} (step 4)") in summary
    assert tg.cut("ok\x1b[2J\n" + "x" * 100, 20) == "'ok\\x1b[2J\\n" + "x" * 13 + "'..."
    assert tg.cut("a question?", 5, tail=True) == "...'tion?'"


def test_wandbs_table_gives_each_reward_a_column(tmp_path, monkeypatch):
    """TRL's table: a column per reward function, so that it sorts by one reward (a stand-in for wandb records
    what the trainer hands it)."""
    tables, logged = [], []

    class Table:
        def __init__(self, columns, data):
            tables.append((columns, data))
    wandb_run = types.SimpleNamespace(log=lambda record, step: logged.append(step), finish=lambda: None)
    stub = types.ModuleType("wandb")
    stub.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    stub.init = lambda **kwargs: wandb_run
    stub.Table = Table
    monkeypatch.setitem(sys.modules, "wandb", stub)
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [1.0] * len(completions)\n"
                                   "def g(completions, **kw):\n    return [None] * len(completions)\n")
    tg.main([*FAST, "--max_steps", "1", "--log_completions", "1", "--report_to", "wandb", "--reward_funcs",
             f"{tmp_path / 'r.py'}:f,{tmp_path / 'r.py'}:g", "--save_dir", str(tmp_path / "run")])
    assert logged == [1]
    ((columns, data),) = tables
    assert columns == ["step", "split", "prompt", "completion", "f", "g", "reward", "advantage"]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert data == [[r["step"], r["split"], r["prompt"], r["completion"], r["rewards"]["f"], r["rewards"]["g"],
                     r["reward"], r["advantage"]] for r in rows]


def test_gsm8k_brings_its_own_rewards_and_any_other_dataset_asks_for_yours(tmp_path, monkeypatch):
    import datasets
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(20)]
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}))
    args = tg.Args(dataset="gsm8k", model_name_or_path="m", batch_size=2, eval_size=2)
    _, _, fns, weights, eval_key = tg.load_task(args, world=1)
    assert fns == [tg.gsm8k_correct_reward, tg.gsm8k_format_reward] and weights == [1.0, 0.1]
    assert eval_key == "eval_accuracy"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))        # GSM8K's rows, but not --dataset gsm8k
    with pytest.raises(tg.TrainerError, match="is not a built-in task: give its rewards with --reward_funcs"):
        tg.load_task(tg.Args(dataset=str(data), model_name_or_path="m", batch_size=2), world=1)


def test_a_run_started_again_needs_its_number_of_processes_too(tmp_path, capsys):
    """args.json records the world size: a 2-process run killed before its first checkpoint, restarted by one
    process, would be another run (another prompt order and rows), so it stops in one line."""
    with pytest.raises(KeyboardInterrupt):
        tg.main([*FAST, "--max_steps", "4", "--save_dir", str(tmp_path)], collect=killed_at_step(2))
    flags = json.load(open(tmp_path / "args.json"))
    assert flags["world_size"] == 1 and flags["resume"] == ""
    flags["world_size"] = 2                                           # as torchrun --nproc_per_node 2 wrote it
    (tmp_path / "args.json").write_text(json.dumps(flags))
    line = one_line_error(in_process(capsys, "--resume", "auto", "--save_dir", tmp_path))
    assert f"{tmp_path} was trained by 2 process(es) and this run has 1" in line and "--nproc_per_node 2" in line
    assert [r["step"] for r in metrics(tmp_path)] == [1]


def test_a_run_started_again_holds_each_step_once_in_tensorboard(tmp_path):
    """The killed attempt's points are purged from its TensorBoard run, as its .jsonl logs are emptied."""
    from tensorboard.backend.event_processing import event_accumulator  # requirements-test.txt only
    flags = [*FAST, "--max_steps", "3", "--report_to", "tensorboard", "--run_name", "tb", "--save_dir", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        tg.main(flags, collect=killed_at_step(3))
    tg.main(["--resume", "auto", "--save_dir", str(tmp_path)])
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
