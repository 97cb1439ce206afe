"""The file reads in order: Args, then all of GRPO, then a PLUMBING banner below which only what runs the step
lives, no formula of it. Short functions, lines that fit a screen (100 characters)."""
import ast
import os

from helpers import ROOT

SOURCE = open(os.path.join(ROOT, "train_grpo.py")).read()
LINES = SOURCE.split("\n")
BANNER = next(i for i, line in enumerate(LINES, 1) if line.startswith("# PLUMBING: what runs the step"))
DEFINED = {n.name: n.lineno for n in ast.parse(SOURCE).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

ALGORITHM = ["Args", "default_epsilon_high", "TrainState", "Trainer", "grpo_step", "loss_divisor", "tokenize_prompts",
             "rollout", "completion_mask", "compute_rewards", "world_std", "compute_advantages", "rows_to_train",
             "completion_logps", "_chunk_logps_entropy", "lm_logits", "selective_log_softmax", "entropy_from_logits",
             "top_k_top_p_filter", "grpo_loss", "lr_factor", "update_entropy_coef", "world_mean"]
PLUMBING = ["train", "frozen_copy", "StepLog", "zero_gradient_without_rows", "call_reward", "check_args",
            "parse_args", "load_task", "load_rows", "load_reward_funcs", "load_model_and_tokenizer",
            "auto_chunk_tokens", "build_optimizer", "setup_distributed", "world_sum", "world_max", "wrap_ddp",
            "shard_fsdp", "update_is_finite", "save_checkpoint", "load_weights", "resume", "step_metrics", "evaluate",
            "log_metrics", "open_report", "main"]
TOP = [n for n in ast.parse(SOURCE).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


def test_all_of_grpo_is_above_the_plumbing_banner_and_no_plumbing_is():
    above = [name for name in ALGORITHM if DEFINED[name] > BANNER]
    below = [name for name in PLUMBING if DEFINED[name] < BANNER]
    assert not above and not below, (above, below)
    assert max(DEFINED[n] for n in ALGORITHM) < min(DEFINED[n] for n in PLUMBING)


def test_the_algorithm_reads_in_at_most_700_lines_above_the_banner_and_the_file_in_1900():
    """The reader's cost: docstring, Args, the step and the helpers it calls in <= 700 lines."""
    assert LINES[BANNER - 2].startswith("# =====") and BANNER - 2 <= 700
    assert len(SOURCE.rstrip("\n").split("\n")) <= 1900


def test_no_function_is_longer_than_80_lines_but_the_step_100():
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(SOURCE))
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > (100 if n.name == "grpo_step" else 80)]
    assert not long


def test_the_step_labels_stages_1_to_14_in_order():
    """grpo_step's comments name the stages (`# 5-6.`, `# 11, after ...`) first in the order 1, 2, ..., 14."""
    import re
    step = next(n for n in TOP if n.name == "grpo_step")
    first = {}
    for i, line in enumerate(LINES[step.lineno - 1:step.end_lineno]):
        label = re.match(r"\s*# (\d+)(?:-(\d+))?[.,]", line)
        if label:
            lo = int(label.group(1))
            for stage in range(lo, int(label.group(2) or lo) + 1):
                first.setdefault(stage, i)
    assert sorted(first) == list(range(1, 15)), sorted(first)
    assert [first[k] for k in range(1, 15)] == sorted(first[k] for k in range(1, 15)), first


def test_each_helper_of_the_algorithm_is_defined_below_every_caller():
    """One direction, top-down: above the banner a function calls only functions defined below it (the loop,
    `train`, is below the banner; Args' fields use `flag`)."""
    above = {n.name: n for n in TOP if n.lineno < BANNER}
    upward = sorted({(name, c.id) for name, n in above.items() if name != "Args"
                     for c in ast.walk(n) if isinstance(c, ast.Name) and c.id in above
                     and above[c.id].lineno < n.lineno and c.id not in ("TrainState", "Trainer")})
    assert not upward


def test_no_line_is_longer_than_100_characters():
    assert [i for i, line in enumerate(LINES, 1) if len(line) > 100] == []


def calls(name):
    """The module's functions and classes a top-level function names (calls, or hands to checkpoint/partial)."""
    node = next(n for n in TOP if n.name == name)
    return {c.id for c in ast.walk(node) if isinstance(c, ast.Name) and c.id in DEFINED and c.id != name}


def test_the_step_shows_the_loss_backward_clip_and_optimizer_step_and_hides_three_bookkeeping_calls():
    step = "\n".join(LINES[DEFINED["grpo_step"] - 1:next(n for n in TOP if n.name == "grpo_step").end_lineno])
    for visible in ("grpo_loss(", "scale(loss).backward()", "clip_grad_norm(", ".step(trainer.optimizer)",
                    "loss_divisor(", "completion_logps("):
        assert visible in step, visible
    below = {n for n in calls("grpo_step") if DEFINED[n] > BANNER}
    assert {"StepLog", "zero_gradient_without_rows", "update_is_finite"} <= below


def test_the_log_probs_are_at_most_three_calls_below_the_step():
    """grpo_step -> completion_logps -> _chunk_logps_entropy -> its formulas, which call nothing of the module."""
    assert "completion_logps" in calls("grpo_step") and "_chunk_logps_entropy" in calls("completion_logps")
    leaves = calls("_chunk_logps_entropy")
    assert leaves <= {"top_k_top_p_filter", "selective_log_softmax", "entropy_from_logits"}, leaves
    assert all(not calls(n) for n in leaves)


def test_nothing_is_more_than_three_calls_below_the_step():
    """Every chain of the module's functions from grpo_step ends within 3 calls (step -> a -> b -> c)."""
    def deepest(name, seen):
        return max([1 + deepest(n, seen | {n}) for n in calls(name) if n not in seen], default=0)
    assert deepest("grpo_step", {"grpo_step"}) <= 3
