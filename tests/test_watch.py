"""Watching a run: each reward function's own values in metrics.jsonl, the completions in completions.jsonl, a few
held-out completions on the console. Each number is checked against one computed here from the logged texts."""
import glob
import json
import math
import os
import statistics
import sys
import time

import pytest

import torch

from helpers import FAST, ROOT, free_port, run_cli, run_commands, tg
from test_custom import wandb_history
from test_real_path import one_thread  # noqa: F401  (an autouse fixture)

# Two rewards of a user's own, in TRL's batched form: f scores every completion, g only those without an 'a'.
REWARDS = """
def f(completions, **kwargs):
    return [len(c) / 10 for c in completions]

def g(completions, **kwargs):
    return [None if "a" in c else float(c.count("b")) for c in completions]
"""


def f(text):
    return len(text) / 10


def g(text):
    return None if "a" in text else float(text.count("b"))


def lines(path):
    return [json.loads(line) for line in open(path)]


def watched_run(tmp_path, *flags, nproc=1):
    (tmp_path / "r.py").write_text(REWARDS)
    res = run_cli(*FAST, "--max_steps", "2", "--reward_funcs", f"{tmp_path / 'r.py'}:f,{tmp_path / 'r.py'}:g",
                  "--reward_weights", "1,0.1", "--log_completions", "1", "--eval_interval", "2",
                  "--save_dir", tmp_path / "run", *flags, nproc=nproc, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res, lines(tmp_path / "run" / "metrics.jsonl"), lines(tmp_path / "run" / "completions.jsonl")


def test_each_reward_is_logged_before_its_weight_and_every_row_with_its_own_advantage(tmp_path):
    res, metrics, completions = watched_run(tmp_path)
    for record in metrics[1:]:
        rows = [c for c in completions if c["step"] == record["step"] and c["split"] == "train"]
        assert len(rows) == 4 * 4                                             # B*G rows of the one rank
        texts = [row["completion"] for row in rows]
        fs = [f(t) for t in texts]
        gs = [g(t) for t in texts if g(t) is not None]                        # a None does not count
        assert [row["rewards"] for row in rows] == [{"f": f(t), "g": g(t)} for t in texts]
        assert record["rewards/f/mean"] == pytest.approx(statistics.mean(fs), rel=1e-12)
        assert record["rewards/f/std"] == pytest.approx(statistics.stdev(fs), rel=1e-9)
        if len(gs) > 1:
            assert record["rewards/g/mean"] == pytest.approx(statistics.mean(gs), rel=1e-12)
            assert record["rewards/g/std"] == pytest.approx(statistics.stdev(gs), rel=1e-9)
        # the total reward of a row is the weighted sum of the values that apply
        totals = [f(t) + 0.1 * (g(t) or 0.0) for t in texts]
        assert [row["reward"] for row in rows] == pytest.approx(totals, rel=1e-6)
        assert record["reward"] == pytest.approx(statistics.mean(totals), rel=1e-6)
        # each row's advantage: its reward against its group's G = 4, divided by the group's std + 1e-4
        for start in range(0, 16, 4):
            group = totals[start:start + 4]
            for i, row in enumerate(rows[start:start + 4]):
                tied = max(group) == min(group)
                want = 0.0 if tied else (group[i] - statistics.mean(group)) / (statistics.stdev(group) + 1e-4)
                assert row["advantage"] == pytest.approx(want, rel=1e-4, abs=1e-5)
    # where every function scores every row, the weighted means sum to the logged reward
    record = metrics[1]
    all_scored = all(c["rewards"]["g"] is not None for c in completions if c["step"] == 1 and c["split"] == "train")
    if all_scored:
        assert record["rewards/f/mean"] + 0.1 * record["rewards/g/mean"] == pytest.approx(record["reward"])
    # the eval logs each function's mean over the held-out greedy completions, and the rows it scored
    evals = [c for c in completions if c["split"] == "eval"]
    assert sorted({c["step"] for c in evals}) == [0, 2] and len(evals) == 2 * 16
    last = [c for c in evals if c["step"] == 2]
    assert metrics[-1]["eval_rewards/f/mean"] == pytest.approx(statistics.mean(f(c["completion"]) for c in last))
    assert metrics[-1]["eval_reward"] == pytest.approx(statistics.mean(c["reward"] for c in last), rel=1e-6)
    assert all(c["advantage"] is None and c["prompt"].endswith("=") for c in evals)


def test_where_every_function_scores_every_row_the_weighted_means_sum_to_the_reward(tmp_path):
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
                                   "def h(completions, **kw):\n    return [float(c.count('b')) for c in completions]\n")
    res = run_cli(*FAST, "--max_steps", "2", "--reward_funcs", f"{tmp_path / 'r.py'}:f,{tmp_path / 'r.py'}:h",
                  "--reward_weights", "1,0.1", "--save_dir", tmp_path / "run", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for record in lines(tmp_path / "run" / "metrics.jsonl"):
        assert record["rewards/f/mean"] + 0.1 * record["rewards/h/mean"] == pytest.approx(record["reward"], rel=1e-6)


def test_two_ranks_log_world_means_and_rank_0_writes_its_own_rows(tmp_path):
    (tmp_path / "r.py").write_text("def f(completions, **kw):\n    return [len(c) / 10 for c in completions]\n")
    res = run_cli(*FAST, "--max_steps", "2", "--reward_funcs", f"{tmp_path / 'r.py'}:f", "--log_completions", "1",
                  "--save_dir", tmp_path / "run", nproc=2, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    completions = lines(tmp_path / "run" / "completions.jsonl")
    for record in lines(tmp_path / "run" / "metrics.jsonl"):
        # one function of weight 1: its world mean is the world's reward, not rank 0's alone
        assert record["rewards/f/mean"] == pytest.approx(record["reward"], rel=1e-6)
        mine = [c for c in completions if c["step"] == record["step"]]
        assert len(mine) == 16 and {c["rank"] for c in mine} == {0}
        rank0 = statistics.mean(c["rewards"]["f"] for c in mine)
        assert rank0 != pytest.approx(record["rewards/f/mean"])              # rank 1's rows count too


def test_a_resumed_run_logs_no_step_twice_and_its_completions_are_the_straight_runs(tmp_path):
    flags = FAST + ["--max_steps", "4", "--log_completions", "1", "--eval_interval", "2", "--save_interval", "2"]
    tg.main(flags + ["--save_dir", str(tmp_path / "straight")])
    calls = [0]

    def crash_at_step_4(args, run, prompt_rows):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("killed")                                       # after step 3 was logged
        return tg.collect_batch(args, run, prompt_rows)
    with pytest.raises(RuntimeError, match="killed"):
        tg.main(flags + ["--save_dir", str(tmp_path / "resumed")], collect=crash_at_step_4)
    assert max(c["step"] for c in lines(tmp_path / "resumed" / "completions.jsonl")) == 3
    tg.main(flags + ["--save_dir", str(tmp_path / "resumed"), "--resume", "auto"])   # from checkpoint-2
    for name in ("completions.jsonl", "metrics.jsonl"):
        straight = lines(tmp_path / "straight" / name)
        resumed = lines(tmp_path / "resumed" / name)
        timings = ("step_time", "generate_time", "tokens_per_s", "peak_mem_gib")
        for row in straight + resumed:
            for key in timings:
                row.pop(key, None)
        assert resumed == straight, name


def test_the_console_shows_held_out_completions_at_each_eval_escaped_and_cut(tmp_path, capsys):
    tg.main(FAST + ["--max_steps", "2", "--eval_interval", "2", "--num_completions_to_print", "2",
                    "--save_dir", str(tmp_path / "a")])
    out = capsys.readouterr().out.splitlines()
    shown = [line for line in out if line.startswith("  step ") and " held-out " in line]
    evals = [c for c in lines(tmp_path / "a" / "completions.jsonl") if c["split"] == "eval"]
    assert len(shown) == 2 * 2                                                # 2 evals, 2 completions each
    for line, sample in zip(shown, [evals[0], evals[8], evals[16], evals[24]]):  # rows 0 and 8 of 16, each eval
        # the reversal task's letters need no escape, and its texts are shorter than a cut: repr is the text in ''
        assert set(sample["prompt"] + sample["completion"]) <= set("abcdefgh=")
        assert len(sample["prompt"]) <= 40 and len(sample["completion"]) <= 60
        assert line == (f"  step {sample['step']} held-out '{sample['prompt']}' -> '{sample['completion']}', "
                        f"reward {sample['reward']:.3f}")
    tg.main(FAST + ["--max_steps", "1", "--eval_interval", "1", "--num_completions_to_print", "0",
                    "--save_dir", str(tmp_path / "b")])
    assert not [line for line in capsys.readouterr().out.splitlines() if " held-out '" in line]


def test_console_text_is_python_repr_of_the_text_cut_to_its_limit():
    """repr escapes what would garble the console (a control character, a newline, an invisible one) and picks
    the quotes; a text over the limit keeps its first `limit` characters, or with tail its last, then marks the
    cut with '...'. By hand:"""
    assert tg.cut("ok") == "'ok'"
    assert tg.cut("x" * 60) == "'" + "x" * 60 + "'"                            # at the limit: whole
    assert tg.cut("x" * 61) == "'" + "x" * 60 + "'..."
    assert tg.cut("ok\x1b[2J\n" + "x" * 100, 20) == "'ok\\x1b[2J\\nxxxxxxxxxxxxx'..."   # 7 characters, then 13 x
    assert tg.cut("a question?", 5, tail=True) == "...'tion?'"
    assert tg.cut("a question?", 11, tail=True) == "'a question?'"
    assert tg.cut("it's", 60) == '"it\'s"'
    assert tg.cut("a\u200bb\tc") == "'a\\u200bb\\tc'"                         # zero-width space, tab
    assert tg.cut("café") == "'café'"                                          # printable: as it is
    assert tg.cut("") == "''"


def test_wandb_and_tensorboard_get_the_completions(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing import event_accumulator  # requirements-test.txt only
    tg.main(FAST + ["--max_steps", "2", "--log_completions", "1", "--report_to", "tensorboard", "--run_name", "tb",
                    "--save_dir", str(tmp_path / "tb")])
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "tensorboard" / "tb"))
    acc.Reload()
    texts = acc.Tensors("completions/text_summary")
    assert [e.step for e in texts] == [1, 2]
    logged = [json.loads(line) for line in texts[0].tensor_proto.string_val[0].decode().splitlines()]
    assert logged == [c for c in lines(tmp_path / "tb" / "completions.jsonl") if c["step"] == 1]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tg.main(FAST + ["--max_steps", "2", "--log_completions", "1", "--report_to", "wandb",
                    "--save_dir", str(tmp_path / "wb")])
    (run_file,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.time() + 60
    while True:
        try:
            tables = [h for h in wandb_history(run_file) if "completions/_type" in h]
        except Exception:
            tables = []
        if len(tables) == 2 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert [h["_step"] for h in tables] == [1, 2]
    assert all(h["completions/_type"] == "table-file" and h["completions/nrows"] == 16 for h in tables)
    # each table: a column per reward function, as TRL's, and completions.jsonl's rows of the step
    logged = lines(tmp_path / "wb" / "completions.jsonl")
    for h in tables:
        table = json.load(open(os.path.join(os.path.dirname(run_file), "files", h["completions/path"])))
        assert table["columns"] == ["step", "split", "prompt", "completion", "reverse_reward", "reward", "advantage"]
        want = [[c["step"], c["split"], c["prompt"], c["completion"], c["rewards"]["reverse_reward"], c["reward"],
                 c["advantage"]] for c in logged if c["step"] == h["_step"]]
        assert table["data"] == want


def test_two_reward_functions_of_one_name_stop_in_one_line(tmp_path, capsys):
    """Each function's name keys its metrics and its column: two of one name stop the run before any work."""
    from test_cli import in_process, one_line_error
    (tmp_path / "a.py").write_text("def f(completions, **kw):\n    return [1.0 for c in completions]\n")
    (tmp_path / "b.py").write_text("def f(completions, **kw):\n    return [2.0 for c in completions]\n"
                                   "def reverse_reward(completions, **kw):\n    return [2.0 for c in completions]\n")
    (tmp_path / "c.py").write_text("def reward(completions, **kw):\n    return [2.0 for c in completions]\n")
    for spec, names in ((f"{tmp_path / 'a.py'}:f,{tmp_path / 'b.py'}:f", "f, f"),
                        (f"reverse_reward,{tmp_path / 'a.py'}:f,{tmp_path / 'b.py'}:reverse_reward",
                         "reverse_reward, f, reverse_reward"),
                        (f"{tmp_path / 'c.py'}:reward", "reward")):   # a name the completions table uses already
        res = in_process(capsys, *FAST, "--max_steps", "1", "--reward_funcs", spec, "--save_dir", tmp_path / "run")
        assert res.returncode == 1
        assert one_line_error(res) == (f"error: --reward_funcs: each function needs a name of its own, and none of "
                                       f"step, split, prompt, completion, reward or advantage (got {names})")
        assert not (tmp_path / "run").exists()


def test_a_reward_that_scores_no_row_has_no_mean_and_one_row_no_std_as_trl():
    """TRL's nanmean and nanstd: a function that returned None everywhere logs NaN, not a 0 that reads as a score."""
    mean, std = tg.world_mean_and_std(torch.tensor([], dtype=torch.float64))
    assert math.isnan(mean) and math.isnan(std)
    mean, std = tg.world_mean_and_std(torch.tensor([0.7], dtype=torch.float64))
    assert mean == 0.7 and math.isnan(std)


def test_a_forks_batch_without_values_per_function_on_one_rank_neither_hangs_nor_drops_a_metric(tmp_path):
    """Every rank runs the same reductions whether or not its Batch brings rewards_per_func: a 2-rank run whose
    collect drops the table on rank 1 only finishes and logs each function's world mean over rank 0's rows."""
    script = tmp_path / "fork.py"
    script.write_text(f"""import sys
sys.path.insert(0, {ROOT!r})
import torch.distributed as dist
import train_grpo as tg

def collect(args, run, prompt_rows):
    batch = tg.collect_batch(args, run, prompt_rows)
    if dist.get_rank() == 1:
        batch.rewards_per_func = None
    return batch

tg.main(sys.argv[1:], collect=collect)
""")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script), *FAST, "--max_steps", "1", "--log_completions", "1",
               "--save_dir", str(tmp_path / "run")]
    (res,) = run_commands(command, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    (record,) = lines(tmp_path / "run" / "metrics.jsonl")
    rank0 = [c["rewards"]["reverse_reward"] for c in lines(tmp_path / "run" / "completions.jsonl")]
    assert record["rewards/reverse_reward/mean"] == pytest.approx(statistics.mean(rank0))
