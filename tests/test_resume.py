"""A resume continues exactly the history it started, or stops in one line that says why and what to type: another
number of processes, a --max_steps below the checkpoint's step, an older checkpoint in a folder that holds a later
one (a branch from it goes into a new folder). --micro_batch_size may change at a resume. --save_total_limit keeps
the newest checkpoints."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import FAST, tg
from test_cli import in_process, one_line_error
from test_real_path import TIMING, one_thread  # noqa: F401  (an autouse fixture)

SHORT = [*FAST, "--max_steps", "5"]


def metrics(save_dir):
    return [json.loads(line) for line in open(os.path.join(save_dir, "metrics.jsonl"))]


def computed(rows):
    """The logged records without the measured times."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def same_weights(a, b):
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def test_a_checkpoint_of_another_number_of_processes_stops_before_any_work(tmp_path, capsys, monkeypatch):
    tg.main([*SHORT, "--stop_after", "2", "--save_dir", str(tmp_path)])
    flags = open(tmp_path / "args.json").read()
    # A checkpoint of 2 processes holds each one's random state: a copy of rank 0's stands for rank 1's.
    shutil.copy(tmp_path / "checkpoint-2" / "rng_state_0.pt", tmp_path / "checkpoint-2" / "rng_state_1.pt")
    line = one_line_error(in_process(capsys, "--resume", "auto", "--save_dir", tmp_path))
    assert "trained by 2 process(es) and this run has 1" in line and "--nproc_per_node 2" in line
    os.remove(tmp_path / "checkpoint-2" / "rng_state_1.pt")
    monkeypatch.setenv("WORLD_SIZE", "2")                      # as torchrun --nproc_per_node 2 sets it
    line = one_line_error(in_process(capsys, "--resume", "auto", "--save_dir", tmp_path))
    assert "trained by 1 process(es) and this run has 2" in line and "--nproc_per_node 1" in line
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2] and open(tmp_path / "args.json").read() == flags


def test_a_max_steps_below_the_checkpoints_step_stops_and_changes_nothing(tmp_path, capsys):
    tg.main([*SHORT, "--stop_after", "4", "--save_dir", str(tmp_path)])
    flags = open(tmp_path / "args.json").read()
    line = one_line_error(in_process(capsys, "--max_steps", "3", "--resume", "auto", "--save_dir", tmp_path))
    assert "--max_steps 3 is below step 4" in line and "give 4 or more" in line
    assert open(tmp_path / "args.json").read() == flags and not (tmp_path / "final").exists()


def files(folder):
    """Every file under folder, by its path there: its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_from_an_older_checkpoint_stops_in_its_folder_and_branches_into_a_new_one(tmp_path, capsys):
    """Checkpoints 2 and 4 in b/: a resume from 2 there would start a second history in b/, so it stops in one line
    that names the later checkpoint and both ways on, and changes nothing. The branch from 2 into c/, stopped after
    3 and continued with --resume auto, is the run that never stopped: its steps 3 to 5 and its final weights."""
    straight, b, c = tmp_path / "straight", tmp_path / "b", tmp_path / "c"
    tg.main([*SHORT, "--save_dir", str(straight)])
    tg.main([*SHORT, "--save_interval", "2", "--stop_after", "4", "--save_dir", str(b)])
    before = files(b)
    assert {"args.json", "metrics.jsonl", "completions.jsonl", "checkpoint-2/model.safetensors",
            "checkpoint-4/model.safetensors"} <= set(before)
    res = in_process(capsys, "--resume", b / "checkpoint-2", "--stop_after", "3")
    assert res.returncode == 2                                          # the argument parser's exit
    line = one_line_error(res)
    assert line == (f"error: --resume {b / 'checkpoint-2'}: {b / 'checkpoint-4'} is later; continue with --resume "
                    f"auto, or branch from it into a new folder with --resume {b / 'checkpoint-2'} --save_dir NEW")
    assert files(b) == before
    tg.main(["--resume", str(b / "checkpoint-2"), "--stop_after", "3", "--save_dir", str(c)])
    assert sorted(p.name for p in c.glob("checkpoint-*")) == ["checkpoint-3"] and not (c / "final").exists()
    tg.main(["--resume", "auto", "--save_dir", str(c)])
    assert [r["step"] for r in metrics(c)] == [3, 4, 5]                 # the branch logs its own steps
    assert computed(metrics(c)) == computed(metrics(straight))[2:]
    assert same_weights(c / "final", straight / "final")
    assert files(b) == before                                           # the branch left b/ as it was


def test_micro_batch_size_may_change_at_a_resume_and_its_step_agrees_to_rounding(tmp_path, capsys, monkeypatch):
    """Resumed with 2 micro-batches of 8 rows instead of one of 16: the step samples what the straight run sampled,
    and its loss and grad norm differ only in the last bits. Under bnpo the micro-batch is part of the loss."""
    straight, b = tmp_path / "straight", tmp_path / "b"
    # dapo: its loss is a token sum over rows of different lengths, not a group mean of advantages, which is 0.
    common = [*SHORT, "--max_steps", "3", "--loss_type", "dapo"]
    tg.main([*common, "--save_dir", str(straight)])
    tg.main([*common, "--stop_after", "2", "--save_dir", str(b)])
    rows = []
    real = tg.completion_logps

    def counting(model, input_ids, *a, **k):
        rows.append(input_ids.shape[0])
        return real(model, input_ids, *a, **k)
    monkeypatch.setattr(tg, "completion_logps", counting)
    capsys.readouterr()
    tg.main(["--micro_batch_size", "8", "--resume", "auto", "--save_dir", str(b)])
    assert rows == [8, 8]
    assert "--micro_batch_size changed at this resume" in capsys.readouterr().out
    got, want = metrics(b)[2], metrics(straight)[2]
    for sampled in ("reward", "reward_std", "completion_len", "truncated_frac"):
        assert got[sampled] == want[sampled]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and abs(want["loss"]) > 1e-3
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    monkeypatch.undo()
    tg.main([*SHORT, "--loss_type", "bnpo", "--stop_after", "1", "--save_dir", str(tmp_path / "bnpo")])
    line = one_line_error(in_process(capsys, "--micro_batch_size", "8", "--resume", "auto", "--save_dir",
                                     tmp_path / "bnpo"))
    assert "--micro_batch_size 8 differs from 0" in line


def test_save_total_limit_keeps_the_newest_and_a_kill_while_deleting_leaves_whole_checkpoints(tmp_path,
                                                                                              monkeypatch):
    """--save_total_limit 2 --save_interval 1, killed while it deletes checkpoint-1 after writing checkpoint-3,
    then resumed: at every moment each checkpoint-<n> folder is whole, and the run ends as the straight one with
    the newest two."""
    straight, b = tmp_path / "straight", tmp_path / "b"
    tg.main([*SHORT, "--save_dir", str(straight)])
    real = shutil.rmtree

    def killed_half_way(path, *a, **k):
        # The deletion of checkpoint-1, under whatever name, is killed once its weights are gone.
        name = os.path.basename(str(path))
        if name.startswith("checkpoint-1") and not name.endswith(".tmp") and os.path.isdir(path):
            os.remove(os.path.join(path, "model.safetensors"))
            raise KeyboardInterrupt
        return real(path, *a, **k)
    monkeypatch.setattr(tg.shutil, "rmtree", killed_half_way)
    common = [*SHORT, "--save_total_limit", "2", "--save_interval", "1", "--save_dir", str(b)]
    with pytest.raises(KeyboardInterrupt):
        tg.main(common)
    monkeypatch.undo()
    whole = [name for name in os.listdir(b) if name.startswith("checkpoint-") and name[11:].isdigit()]
    assert sorted(whole) == ["checkpoint-2", "checkpoint-3"]
    assert all((b / name / "model.safetensors").exists() for name in whole)
    tg.main([*common, "--resume", "auto"])
    assert sorted(name for name in os.listdir(b) if name.startswith("checkpoint-")) == ["checkpoint-4",
                                                                                        "checkpoint-5"]
    assert computed(metrics(b)) == computed(metrics(straight))
    assert same_weights(b / "final", straight / "final")


def test_a_kill_while_a_log_is_trimmed_leaves_the_log_whole(tmp_path, monkeypatch):
    """The trimmed log is written aside and renamed: a kill before the rename (here os.replace raising) leaves the
    log as it was, never empty."""
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    before = log.read_text()

    def killed(*args):
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(tg.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        tg.trim_log(str(log), 2)
    assert log.read_text() == before
    monkeypatch.undo()
    tg.trim_log(str(log), 2)
    assert [json.loads(line)["step"] for line in open(log)] == [1, 2]


def test_a_checkpoint_named_from_inside_its_folder_resumes_there(tmp_path, monkeypatch):
    tg.main([*SHORT, "--stop_after", "2", "--save_dir", str(tmp_path / "a")])
    monkeypatch.chdir(tmp_path / "a")
    tg.main(["--resume", "checkpoint-2"])
    assert [r["step"] for r in metrics(tmp_path / "a")] == [1, 2, 3, 4, 5]


def test_a_stop_after_not_after_the_checkpoints_step_stops_in_one_line(tmp_path, capsys):
    tg.main([*SHORT, "--stop_after", "2", "--save_dir", str(tmp_path)])
    line = one_line_error(in_process(capsys, "--resume", "auto", "--stop_after", "2", "--save_dir", tmp_path))
    assert "--stop_after 2 is not after step 2" in line
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_a_checkpoint_whose_state_does_not_read_stops_in_one_line_before_any_work(tmp_path, capsys):
    """A checkpoint of another train_grpo.py (its TrainState named otherwise), or one missing a rank's RNG file:
    one line, and nothing written, where a traceback would come after the model had loaded."""
    tg.main([*SHORT, "--stop_after", "2", "--save_dir", str(tmp_path / "a")])
    ckpt = tmp_path / "a" / "checkpoint-2"
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    state["c"] = state.pop("entropy_coef")                         # as an older file named it
    torch.save(state, ckpt / "trainer_state.pt")
    line = one_line_error(in_process(capsys, "--resume", ckpt, "--save_dir", tmp_path / "b"))
    assert "is not a run this train_grpo.py can continue" in line and "'c'" in line
    state["entropy_coef"] = state.pop("c")
    torch.save(state, ckpt / "trainer_state.pt")
    os.replace(ckpt / "rng_state_0.pt", ckpt / "rng_state_1.pt")   # one file, but not rank 0's
    line = one_line_error(in_process(capsys, "--resume", ckpt, "--save_dir", tmp_path / "b"))
    assert "rng_state_0.pt" in line
    assert not (tmp_path / "b").exists()


def test_a_checkpoint_holding_another_models_weights_stops_naming_a_weight_that_does_not_fit(tmp_path, capsys):
    tg.main([*SHORT, "--stop_after", "2", "--save_dir", str(tmp_path / "dense")])
    tg.main([*SHORT, "--max_steps", "1", "--use_moe", "1", "--save_dir", str(tmp_path / "moe")])
    dense = load_file(tmp_path / "dense" / "checkpoint-2" / "model.safetensors")
    moe = load_file(tmp_path / "moe" / "final" / "model.safetensors")
    for name in ("model.safetensors", "config.json"):                # the MoE's weights in the dense run's checkpoint
        shutil.copy(tmp_path / "moe" / "final" / name, tmp_path / "dense" / "checkpoint-2" / name)
    # The first weight in name order that one model lacks or holds in another shape: the same on every rank and run.
    misfits = [k for k in sorted({*dense, *moe}) if k not in dense or k not in moe or dense[k].shape != moe[k].shape]
    line = one_line_error(in_process(capsys, "--resume", "auto", "--save_dir", tmp_path / "dense"))
    assert f"is from another model: {misfits[0]} is missing from one of the two, or shaped otherwise" in line
