"""The command line: end-to-end runs, HF-format outputs, bad input as one line (steps 13-14 of the README's "The math")."""
import json
import math

import pytest

from helpers import FAST, run_cli, tg


@pytest.mark.parametrize("use_moe", [0, 1])
def test_short_run_writes_finite_metrics_and_a_loadable_model(tmp_path, use_moe):
    res = run_cli(*FAST, "--max_steps", "3", "--use_moe", use_moe, "--eval_interval", "3", "--sft_warmup_steps", "3",
                  "--save_interval", "2", "--save_dir", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # greedy evals and saves print nothing beside the bar: no sampling-flag warning, no "Writing model shards"
    assert "generation flags" not in res.stderr and "Writing model shards" not in res.stderr
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert rows[0] == {"step": 0, "eval_accuracy": rows[0]["eval_accuracy"]}  # before the first update
    steps = rows[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]
    keys = ["reward", "reward_std", "frac_reward_zero_std", "advantage_std", "loss", "policy_loss", "kl", "entropy",
            "entropy_coef", "entropy_coef_applied", "clip_ratio", "completion_len", "truncated_frac", "grad_norm",
            "lr", "step_time", "tokens_per_s"] + (["aux_loss"] if use_moe else [])
    for r in steps:
        for k in keys:
            assert math.isfinite(r[k]), (k, r)
    assert "eval_accuracy" in steps[-1]
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if use_moe else "Qwen3ForCausalLM")


def one_line_error(res):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("argv, words", [
    (["--loss_type", "ppo"], "loss_type"),
    (["--num_generations", "1"], "num_generations"),
    (["--batch_size", "0"], "batch_size"),
    (["--model_name_or_path", "someone/model", "--dataset", "no/such/file.jsonl"], "no such file"),
    (["--resume", "no/such/checkpoint"], "no such checkpoint"),
])
def test_bad_arguments_give_one_line(argv, words):
    line = one_line_error(run_cli(*argv))
    assert words in line


def test_help_lists_every_flag():
    res = run_cli("--help")
    assert res.returncode == 0
    for f in ["--loss_type", "--use_moe", "--model_name_or_path", "--dataset", "--num_generations",
              "--batch_size", "--max_steps", "--learning_rate", "--beta", "--epsilon", "--epsilon_high",
              "--num_iterations", "--scale_rewards", "--mask_truncated_completions", "--temperature", "--top_p",
              "--top_k", "--max_prompt_len", "--max_gen_len", "--grad_clip", "--seed", "--save_dir",
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
    (0.0, 2, 8, 4, 1),    # mu = 2, 2 micro-batches: 4 graph forwards, old log-probs once
])
def test_forwards_per_step(tmp_path, monkeypatch, beta, mu, micro, graph, no_grad):
    import torch
    counts = {"graph": 0, "no_grad": 0}
    real = tg.completion_logps

    def counting(*a, **k):
        counts["graph" if torch.is_grad_enabled() else "no_grad"] += 1
        return real(*a, **k)
    monkeypatch.setattr(tg, "completion_logps", counting)
    tg.main(FAST + ["--max_steps", "2", "--beta", str(beta), "--num_iterations", str(mu),
                    "--micro_batch_size", str(micro), "--skip_zero_advantage_rows", "0",
                    "--save_dir", str(tmp_path)])  # every row trained: the counts do not depend on ties
    assert counts == {"graph": 2 * graph, "no_grad": 2 * no_grad}


def test_beta_and_mu_run(tmp_path):
    # the reference forward (beta > 0) and old log-probs computed once for mu = 2 updates
    res = run_cli(*FAST, "--max_steps", "2", "--beta", "0.04", "--num_iterations", "2", "--micro_batch_size", "8",
                  "--loss_type", "cispo", "--gradient_checkpointing", "1", "--save_dir", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert all(math.isfinite(r["kl"]) for r in rows)
