"""The command line: end-to-end runs, HF-format outputs, bad input as one line (steps 13-14 of the README's "The math")."""
import json
import math

import pytest
import torch

from helpers import FAST, run_clis, tg
from test_real_path import one_thread  # noqa: F401  (an autouse fixture)


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """Both short CLI runs (dense and MoE), side by side: {use_moe: (CompletedProcess, save_dir)}."""
    dirs = {moe: tmp_path_factory.mktemp(f"short_moe{moe}") for moe in (0, 1)}
    runs = run_clis(*([*FAST, "--max_steps", "3", "--use_moe", moe, "--eval_interval", "3", "--sft_warmup_steps",
                       "3", "--save_interval", "2", "--save_dir", dirs[moe]] for moe in (0, 1)))
    return {moe: (res, dirs[moe]) for moe, res in zip((0, 1), runs)}


@pytest.mark.parametrize("use_moe", [0, 1])
def test_short_run_writes_finite_metrics_and_a_loadable_model(short_runs, use_moe):
    res, save_dir = short_runs[use_moe]
    assert res.returncode == 0, res.stderr[-3000:]
    # greedy evals and saves print nothing beside the bar: no sampling-flag warning, no "Writing model shards"
    assert "generation flags" not in res.stderr and "Writing model shards" not in res.stderr
    rows = [json.loads(l) for l in open(save_dir / "metrics.jsonl")]
    assert sorted(rows[0]) == ["eval_accuracy", "eval_rewards/reverse_reward/mean", "eval_rewards/reverse_reward/std",
                               "step"]  # before the first update
    assert rows[0]["step"] == 0
    steps = rows[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    keys = ["reward", "reward_std", "frac_reward_zero_std", "advantage_std", "loss", "policy_loss", "kl", "entropy",
            "entropy_coef", "entropy_coef_applied", "clip_ratio", "completion_len", "truncated_frac", "grad_norm",
            "learning_rate", "step_time", "tokens_per_s", "rewards/reverse_reward/mean",
            "rewards/reverse_reward/std"] + (["aux_loss"] if use_moe else [])
    for r in steps:
        for k in keys:
            assert math.isfinite(r[k]), (k, r)
    assert "eval_accuracy" in steps[-1]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(save_dir / "final")
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if use_moe else "Qwen3ForCausalLM")


def one_line_error(res):
    """res: a CompletedProcess, or anything with returncode and stderr (see in_process)."""
    assert res.returncode not in (0, None)
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    return errors[0]


class in_process:
    """tg.cli(argv), the function `python train_grpo.py` runs, in this process: its exit status and stderr.
    An exception other than the argument parser's exit fails the test, as a traceback would."""

    def __init__(self, capsys, *argv):
        capsys.readouterr()
        try:
            self.returncode = tg.cli([str(a) for a in argv])
        except SystemExit as e:  # the argument parser exits with status 2
            self.returncode = e.code
        captured = capsys.readouterr()
        self.stdout, self.stderr = captured.out, captured.err


@pytest.mark.parametrize("argv, words", [
    (["--loss_type", "ppo"], "loss_type"),
    (["--num_generations", "1"], "num_generations"),
    (["--batch_size", "0"], "batch_size"),
    (["--model_name_or_path", "someone/model", "--dataset", "no/such/file.jsonl"], "Unable to find"),
    (["--resume", "no/such/checkpoint"], "no such checkpoint"),
])
def test_bad_arguments_give_one_line(capsys, argv, words):
    line = one_line_error(in_process(capsys, *argv))
    assert words in line


def test_help_lists_every_flag(capsys):
    res = in_process(capsys, "--help")
    assert res.returncode == 0
    for f in ["--loss_type", "--use_moe", "--model_name_or_path", "--dataset", "--num_generations",
              "--batch_size", "--max_steps", "--learning_rate", "--beta", "--epsilon", "--epsilon_high",
              "--num_iterations", "--scale_rewards", "--mask_truncated_completions", "--temperature",
              "--max_prompt_len", "--max_gen_len", "--grad_clip", "--seed", "--save_dir",
              "--save_interval", "--eval_interval", "--dtype", "--device", "--entropy_coef", "--use_adaptive_entropy",
              "--entropy_target", "--entropy_coef_delta", "--entropy_coef_min", "--entropy_coef_max", "--resume"]:
        assert f in res.stdout, f


def test_import_runs_nothing(tmp_path):
    import subprocess, sys
    from helpers import ROOT
    out = subprocess.run([sys.executable, "-c", "import train_grpo, os; print(sorted(os.listdir('.')))"],
                         cwd=tmp_path, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("beta, mu, micro, graph, no_grad", [
    (0.0, 1, 0, 1, 0),    # on-policy: one forward with grad, old = logps.detach()
    (0.04, 1, 0, 1, 1),   # + one reference forward
    (0.0, 2, 8, 4, 2),    # mu = 2, 2 micro-batches: 4 graph forwards, old log-probs once, a micro-batch at a time
    (0.04, 2, 8, 4, 4),   # + the reference, also a micro-batch at a time
])
def test_forwards_per_step(tmp_path, monkeypatch, beta, mu, micro, graph, no_grad):
    counts = {"graph": 0, "no_grad": 0}
    widest = {"graph": 0, "no_grad": 0}   # the most rows one forward took
    real = tg.completion_logps

    def counting(model, input_ids, *a, **k):
        kind = "graph" if torch.is_grad_enabled() else "no_grad"
        counts[kind] += 1
        widest[kind] = max(widest[kind], input_ids.shape[0])
        return real(model, input_ids, *a, **k)
    monkeypatch.setattr(tg, "completion_logps", counting)
    extra = []
    if beta and mu > 1:   # the reference and mu = 2 under cispo with gradient checkpointing: a finite KL too
        extra = ["--loss_type", "cispo", "--gradient_checkpointing", "1"]
    tg.main(FAST + ["--max_steps", "2", "--beta", str(beta), "--num_iterations", str(mu),
                    "--micro_batch_size", str(micro), "--save_dir", str(tmp_path), *extra])
    assert counts == {"graph": 2 * graph, "no_grad": 2 * no_grad}
    # FAST: 4 prompts x 4 = 16 rows a step; no forward, with or without a graph, takes more than a micro-batch
    assert widest["graph"] == (micro or 16) and widest["no_grad"] <= (micro or 16)
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2 and all(math.isfinite(r["kl"]) for r in rows)
