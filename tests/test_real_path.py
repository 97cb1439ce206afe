"""The real path (issue: hub models and GSM8K): loading code fed a model and data the tests make or ship."""
import json
import math
import os
import string
from fractions import Fraction

import pytest
import torch

from helpers import FAST, ROOT, run_cli, run_clis, tg, tiny

SAMPLE = os.path.join(ROOT, "tests", "data", "gsm8k_sample.jsonl")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
REAL = ["--batch_size", "2", "--num_generations", "2", "--max_gen_len", "8", "--max_prompt_len", "400",
        "--eval_size", "4", "--eval_interval", "0"]


def save_tiny(path, moe=False):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    tok = tg.build_char_tokenizer(string.printable)
    tok.chat_template = CHAT_TEMPLATE
    kw = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, intermediate_size=64, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
              eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, **kw))
             if moe else Qwen3ForCausalLM(Qwen3Config(**kw)))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("dense"))


# ---- GSM8K answers ----
@pytest.mark.parametrize("completion, reference, correct", [
    ("so the total is 14.\n#### 14", "worked...\n#### 14", True),
    ("#### 1,250", "#### 1250", True),
    ("The answer is $1,250.", "#### 1250", True),
    ("#### $45.00", "#### 45", True),
    ("#### 45.0", "#### 45", True),
    ("#### 45.", "#### 45", True),
    ("It dropped to -7 degrees.\n#### -7", "#### -7", True),
    ("#### 7", "#### -7", False),
    ("#### -7", "#### 7", False),
    ("first 12 then 30, finally 42", "#### 42", True),
    ("first 42 then 30", "#### 42", False),             # the last number counts when nothing is tagged
    ("#### 42\nbut maybe 17", "#### 42", True),          # a tagged answer beats a later number
    ("answer is 42, I think 17", "#### 42", True),
    ("\\boxed{12.5}", "#### 12.5", True),
    ("#### 12.50", "#### 12.5", True),
    ("#### 0.1", "#### 0.10", True),
    ("no number here", "#### 3", False),
    ("", "#### 3", False),
    ("#### 3/4", "#### 3", True),                        # '3/4': the tag takes the 3; the reference is 3
    ("#### 1e9", "#### 1", True),                        # no scientific notation: the number is 1
    ("The total is 2,400 books.", "2400", True),        # a bare reference number
    ("#### 10", "#### 10\n", True),
    ("__import__('os').system('echo pwned') 5", "#### 5", True),  # model text is parsed, never evaluated
    ("so \\boxed{1{,}000}", "#### 1000", True),          # LaTeX's thousands separator
    ("#### 1 000", "#### 1000", True),                   # digit groups separated by a space
    ("#### 1 0000", "#### 1", True),                     # not a digit group: the number is 1
])
def test_gsm8k_correctness(completion, reference, correct):
    assert tg.gsm8k_correct_reward(completion, reference) == float(correct)


def test_gsm8k_number_parsing_and_format_reward():
    assert tg.parse_number("$1,234.50") == Fraction(2469, 2)
    assert tg.parse_number("-0.25") == Fraction(-1, 4)
    assert tg.parse_number("abc") is None
    assert tg.gsm8k_format_reward("work\n#### 12", "#### 12") == 1.0
    assert tg.gsm8k_format_reward("#### 12 and then more words", "#### 12") == 0.0
    # every shipped sample's reference parses
    rows = [json.loads(l) for l in open(SAMPLE)]
    assert len(rows) >= 30 and all(tg.gsm8k_reference(r["answer"]) is not None for r in rows)


# ---- the hub path on local things ----
def test_two_rank_run_on_saved_model_and_gsm8k_file(tmp_path, dense_dir):
    res = run_cli(*REAL, "--model_name_or_path", dense_dir, "--dataset", SAMPLE, "--max_steps", "2",
                  "--save_dir", tmp_path, nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in rows)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert AutoTokenizer.from_pretrained(tmp_path / "checkpoint-2").chat_template == CHAT_TEMPLATE


def test_moe_checkpoint_and_bf16(tmp_path):
    moe_dir = save_tiny(tmp_path / "moe", moe=True)
    res = run_cli(*REAL, "--model_name_or_path", moe_dir, "--dataset", SAMPLE, "--max_steps", "1", "--use_moe", "1",
                  "--dtype", "bfloat16", "--save_dir", tmp_path / "run")
    assert res.returncode == 0, res.stderr[-3000:]
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert math.isfinite(row["aux_loss"]) and row["aux_loss"] > 0


def test_parquet_with_other_field_names(tmp_path, dense_dir):
    import datasets
    rows = [json.loads(l) for l in open(SAMPLE)]
    datasets.Dataset.from_dict({"problem": [r["question"] for r in rows], "solution": [r["answer"] for r in rows]}
                               ).to_parquet(str(tmp_path / "data.parquet"))
    res = run_cli(*REAL, "--model_name_or_path", dense_dir, "--dataset", tmp_path / "data.parquet", "--max_steps", "1",
                  "--question_field", "problem", "--answer_field", "solution", "--save_dir", tmp_path / "run")
    assert res.returncode == 0, res.stderr[-3000:]


def test_unreachable_hub_dataset_is_one_line(tmp_path, dense_dir):
    from test_cli import one_line_error
    line = one_line_error(run_cli(*REAL, "--model_name_or_path", dense_dir, "--dataset", "someone/no-such-dataset",
                                  "--save_dir", tmp_path))
    assert "someone/no-such-dataset" in line


def test_use_moe_with_dense_checkpoint_is_one_line(tmp_path, dense_dir):
    from test_cli import one_line_error
    line = one_line_error(run_cli(*REAL, "--model_name_or_path", dense_dir, "--dataset", SAMPLE, "--use_moe", "1",
                                  "--save_dir", tmp_path))
    assert "dense" in line


@pytest.mark.parametrize("content, words", [("", "empty"), ('{"q": "x", "a": "#### 1"}\n', "question, answer")])
def test_bad_dataset_is_one_line(tmp_path, dense_dir, content, words):
    from test_cli import one_line_error
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    line = one_line_error(run_cli(*REAL, "--model_name_or_path", dense_dir, "--dataset", path, "--save_dir", tmp_path))
    assert words in line


def test_long_prompts_are_left_truncated_and_counted(tmp_path):
    res = run_cli(*FAST, "--max_steps", "2", "--max_prompt_len", "3", "--save_dir", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (res.stdout + res.stderr).count("left-truncated") == 1  # warned once
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["truncated_prompts"] == 2 * 4  # every prompt of both steps


# ---- checkpoints and exact resume ----
TIMING = {"step_time", "generate_time", "tokens_per_s", "generate_share", "peak_mem_gib"}  # measured, not computed


def load_final(d):
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "final", "model.safetensors"))


@pytest.mark.parametrize("nproc, dtype, moe", [(1, "float32", 0), (2, "float32", 0), (1, "bfloat16", 1),
                                               (2, "float32", 1)])
def test_resume_continues_exactly(tmp_path, nproc, dtype, moe):
    # MoE too: transformers saves its fused experts one tensor per expert, and resume must read them back
    common = [*FAST, "--max_steps", "4", "--lr_scheduler", "cosine", "--warmup_steps", "2", "--beta", "0.04",
              "--sft_warmup_steps", "3", "--use_adaptive_entropy", "1", "--entropy_target", "5",
              "--max_prompt_len", "5", "--dtype", dtype, "--use_moe", moe]  # every prompt is cut: the truncation counter must survive the resume too
    a, b = tmp_path / "a", tmp_path / "b"
    straight, first = run_clis([*common, "--save_dir", a], [*common, "--stop_after", "2", "--save_dir", b],
                               nproc=nproc)
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert first.returncode == 0 and not (b / "final").exists(), first.stderr[-2000:]
    second = run_cli(*common, "--resume", "auto", "--save_dir", b, nproc=nproc)
    assert second.returncode == 0, second.stderr[-3000:]
    wa, wb = load_final(a), load_final(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ma = [json.loads(l) for l in open(a / "metrics.jsonl")]
    mb = [json.loads(l) for l in open(b / "metrics.jsonl")]
    assert [r["step"] for r in mb] == [1, 2, 3, 4] and mb[-1]["truncated_prompts"] == 4 * 4 * nproc
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}
    assert [strip(r) for r in ma[2:]] == [strip(r) for r in mb[2:]]


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    model, tok = tiny()
    tg.save_checkpoint(str(tmp_path), 1, model, tok, {"step": 1}, rank=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(tg.torch, "save", broken)
    with pytest.raises(OSError):
        tg.save_checkpoint(str(tmp_path), 2, model, tok, {"step": 2}, rank=0)
    monkeypatch.undo()
    assert tg.find_checkpoint(str(tmp_path)).endswith("checkpoint-1")
    fresh, _ = tiny()
    tg.load_weights(fresh, tg.find_checkpoint(str(tmp_path)))
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)
    assert torch.load(tmp_path / "checkpoint-1" / "trainer_state.pt", weights_only=True)["step"] == 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1")


def test_resume_of_another_model_shape_is_one_line(tmp_path):
    from test_cli import one_line_error
    assert run_cli(*FAST, "--max_steps", "1", "--save_dir", tmp_path).returncode == 0
    line = one_line_error(run_cli(*FAST, "--max_steps", "2", "--use_moe", "1", "--resume", "auto", "--save_dir", tmp_path))
    assert "another model" in line
    assert (tmp_path / "checkpoint-1" / "model.safetensors").exists()  # nothing already saved is lost


def test_resume_from_a_final_directory_is_one_line(tmp_path):
    # final/ holds weights but no trainer state: refused naming the missing file, no traceback
    from test_cli import one_line_error
    assert run_cli(*FAST, "--max_steps", "1", "--save_dir", tmp_path).returncode == 0
    line = one_line_error(run_cli(*FAST, "--max_steps", "2", "--resume", tmp_path / "final",
                                  "--save_dir", tmp_path / "b"))
    assert "has no trainer_state.pt" in line


# ---- failures inside the loop ----
def test_reward_that_raises_names_the_sample(tmp_path, monkeypatch):
    def bad(completion, answer):
        raise ValueError("boom")
    monkeypatch.setattr(tg, "reverse_reward", bad)
    with pytest.raises(tg.TrainerError, match=r"reward bad raised on sample 0 .*boom"):
        tg.main(FAST + ["--max_steps", "1", "--save_dir", str(tmp_path)])


def test_reward_that_is_not_a_finite_number_names_the_function_and_sample(tmp_path, monkeypatch):
    for bad_value, shown in ((float("nan"), "nan, not a finite number"), (float("inf"), "inf, not a finite number"),
                             ("0.5", "'0.5', not a number"),
                             # None: "does not apply" (TRL's meaning); the only reward, so nothing scores it
                             (None, None)):
        def bad(completion, answer, calls=[0]):
            calls[0] += 1
            return 0.5 if calls[0] != 3 else bad_value                       # the third sample is bad
        monkeypatch.setattr(tg, "reverse_reward", bad)
        error = (rf"^reward bad returned {shown}, on sample 2 " if shown else
                 r"^every reward function returned None \(does not apply\) on sample 2 ")
        with pytest.raises(tg.TrainerError, match=error):
            tg.main(FAST + ["--max_steps", "1", "--save_dir", str(tmp_path)])


def test_non_finite_steps_are_skipped_then_stop_with_last_checkpoint_intact(tmp_path, monkeypatch):
    calls = [0]
    real = tg.compute_advantages

    def nan_after_two_steps(*a, **kw):  # a loss that is not finite from the third step on
        calls[0] += 1
        return real(*a, **kw) * (1.0 if calls[0] <= 2 else float("nan"))
    monkeypatch.setattr(tg, "compute_advantages", nan_after_two_steps)
    with pytest.raises(tg.TrainerError, match="loss not finite, .* for 3 steps in a row"):
        tg.main(FAST + ["--max_steps", "8", "--save_interval", "1", "--save_dir", str(tmp_path)])
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["skipped_steps_in_a_row"] for r in rows] == [0, 0, 1, 2]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 2]
    last = tg.find_checkpoint(str(tmp_path))
    model, _ = tiny()
    tg.load_weights(model, last)
    assert all(torch.isfinite(p).all() for p in model.parameters())
