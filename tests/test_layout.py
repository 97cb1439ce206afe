"""The file reads in order: Args, then all of GRPO, then a PLUMBING banner below which nothing is GRPO.
Short functions, lines that fit a screen (100 characters)."""
import ast
import os

from helpers import ROOT

SOURCE = open(os.path.join(ROOT, "train_grpo.py")).read()
LINES = SOURCE.split("\n")
BANNER = next(i for i, line in enumerate(LINES, 1) if line.startswith("# PLUMBING: nothing below is GRPO"))
DEFINED = {n.name: n.lineno for n in ast.parse(SOURCE).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

ALGORITHM = ["Args", "tokenize_prompts", "rollout", "completion_mask", "compute_rewards", "compute_advantages",
             "selective_log_softmax", "entropy_from_logits", "completion_logps", "chunked_logps", "truncate_logits",
             "grpo_loss", "aggregate", "importance_weights", "update_entropy_coef", "world_mean",
             "clipped_optimizer_step", "grpo_step", "accumulate_gradients", "train"]
PLUMBING = ["check_args", "parse_args", "load_task", "load_rows", "load_reward_funcs", "load_model_and_tokenizer",
            "frozen_copy", "setup_distributed", "wrap_ddp", "shard_fsdp", "save_checkpoint", "load_weights",
            "resume", "evaluate", "log_metrics", "open_report", "main"]


def test_all_of_grpo_is_above_the_plumbing_banner_and_no_plumbing_is():
    above = [name for name in ALGORITHM if DEFINED[name] > BANNER]
    below = [name for name in PLUMBING if DEFINED[name] < BANNER]
    assert not above and not below, (above, below)
    assert max(DEFINED[n] for n in ALGORITHM) < min(DEFINED[n] for n in PLUMBING)


def test_no_function_is_longer_than_80_lines():
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(SOURCE))
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80]
    assert not long


def test_no_line_is_longer_than_100_characters():
    assert [i for i, line in enumerate(LINES, 1) if len(line) > 100] == []
