"""The real path (issue: hub models and GSM8K): loading code fed a model and data the tests make or ship."""
import atexit
import json
import math
import os
import shutil
import string
import tempfile

import pytest
import torch

from helpers import FAST, ROOT, free_ports, make_run, run_cli, spawn, tg, tiny

SAMPLE = os.path.join(ROOT, "tests", "data", "gsm8k_sample.jsonl")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
REAL = ["--batch_size", "2", "--num_generations", "2", "--max_gen_len", "8", "--max_prompt_len", "400",
        "--eval_size", "4", "--eval_interval", "0"]
# A file of GSM8K's rows is not the built-in task (--dataset gsm8k is): its rewards are named, as a user names them.
GSM8K_REWARDS = ["--reward_funcs", "gsm8k_correct_reward,gsm8k_format_reward"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Torch's own threads on the tiny models of these tests: each op is too small to split, and with two cores
    shared they spin against each other (a step takes 10x longer). Subprocesses get OMP_NUM_THREADS=1 too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


# ---- every 2-rank run of this file and of test_user_paths, in one pair of processes ----
# A pair's start-up (torch, transformers, the first step) costs more than these runs together.
RESUME = [*FAST, "--max_steps", "4", "--lr_scheduler", "cosine", "--warmup_steps", "2", "--beta", "0.04",
          "--sft_warmup_steps", "3", "--use_adaptive_entropy", "1", "--entropy_target", "5",
          "--max_prompt_len", "5"]  # every prompt is cut
RESUME_2_RANKS = [("float32", 0), ("float32", 1)]
BF16_KL = [*FAST, "--max_steps", "1", "--beta", "0.04", "--dtype", "bfloat16", "--sft_warmup_steps", "3"]


def two_rank_jobs(rank, world, out, jobs, ports):
    """jobs: ("main", argv, note) runs the trainer as torchrun's worker would (then, with a note, rank 0 writes
    whether save_dir holds final/ to save_dir + note), or (worker, (), None) a dist_workers function. Each in its
    own process group, on a port of its own."""
    import dist_workers
    for (kind, argv, note), port in zip(jobs, ports):
        os.environ["MASTER_PORT"] = str(port)
        if kind != "main":
            getattr(dist_workers, kind)(rank, world, out)
            continue
        tg.main(argv)
        save_dir = argv[argv.index("--save_dir") + 1]
        if rank == 0 and note:
            with open(save_dir + note, "w") as f:
                json.dump({"final": os.path.isdir(os.path.join(save_dir, "final"))}, f)


_TWO_RANKS = {}


def two_rank_runs():
    """The folder of the 2-rank runs, made once per session; a failure is raised again to every test using it."""
    if not _TWO_RANKS:
        out = tempfile.mkdtemp(prefix="two_ranks_")
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        dense = save_tiny(os.path.join(out, "dense"))
        jobs = [("main", [*REAL, "--model_name_or_path", dense, "--dataset", SAMPLE, *GSM8K_REWARDS, "--max_steps",
                          "2", "--save_dir", os.path.join(out, "gsm8k")], None),
                ("main", [*BF16_KL, "--save_dir", os.path.join(out, "bf16_kl")], None),
                ("eval_uneven", (), None)]
        for dtype, moe in RESUME_2_RANKS:
            common = [*RESUME, "--dtype", dtype, "--use_moe", str(moe)]
            where = os.path.join(out, f"resume_{dtype}_{moe}")
            jobs += [("main", [*common, "--save_dir", os.path.join(where, "a")], None),
                     ("main", [*common, "--stop_after", "2", "--save_dir", os.path.join(where, "b")], ".after.json"),
                     ("main", [*common, "--resume", "auto", "--save_dir", os.path.join(where, "b")], None)]
        try:
            spawn(two_rank_jobs, out, jobs, free_ports(len(jobs)), timeout=300)
            _TWO_RANKS["out"] = out
        except Exception as e:
            _TWO_RANKS["error"] = e
    if "error" in _TWO_RANKS:
        raise RuntimeError("the 2-rank runs failed: see the exception above") from _TWO_RANKS["error"]
    from pathlib import Path
    return Path(_TWO_RANKS["out"])


# ---- GSM8K answers ----
# lm-eval-harness's strict match, worked by hand: the completion's first '#### N' (N of -, digits, '.' and ','),
# else "[invalid]"; then in it and in the reference: ',' and '$' go, everything up to the last '#### ', and a final
# '.'; the two strings, lowercased, must be equal.
@pytest.mark.parametrize("completion, reference, correct", [
    ("so the total is 14.\n#### 14", "worked...\n#### 14", True),
    ("#### 1,250", "#### 1250", True),                  # '1250' = '1250'
    ("#### 1,234", "1234", True),
    ("#### $45.00", "#### 45", False),                  # '$' is not in N: no match, "[invalid]"
    ("#### $18", "#### 18", False),
    ("#### 45.0", "#### 45", False),                    # '45.0' != '45': strings, not numbers
    ("#### 45.", "#### 45", True),                      # the final '.' goes
    ("#### 72.", "72", True),
    ("####72", "#### 72", False),                       # the space after '####' is part of the tag
    ("It dropped to -7 degrees.\n#### -7", "#### -7", True),
    ("#### 7", "#### -7", False),
    ("#### -7", "#### 7", False),
    ("first 12 then 30, finally 42", "#### 42", False),   # strict: without '#### ' no number counts
    ("The answer is $1,250.", "#### 1250", False),
    ("\\boxed{12.5}", "#### 12.5", False),
    ("#### 42\nbut maybe 17", "#### 42", True),          # a tagged answer beats a later number
    ("#### 17\nno, #### 42", "#### 17", True),           # the first tag counts, as lm-eval's strict match
    ("#### 12.50", "#### 12.5", False),                  # '12.50' != '12.5'
    ("#### 0.1", "#### 0.10", False),                    # '0.1' != '0.10'
    ("no number here", "#### 3", False),
    ("", "#### 3", False),
    ("#### 3/4", "#### 3", True),                        # N stops at '/': '3'
    ("#### 1e9", "#### 1", True),                        # N stops at 'e': '1'
    ("#### 2,400", "2400", True),                        # a bare reference number
    ("#### 10", "#### 10\n", False),                     # '10' != '10\n': the reference is not stripped
    ("__import__('os').system('echo pwned')\n#### 5", "#### 5", True),  # model text is matched, never evaluated
    ("#### __import__('os').system('echo pwned')", "#### 0", False),
])
def test_gsm8k_correctness(completion, reference, correct):
    assert tg.gsm8k_correct_reward([completion], [reference]) == [float(correct)]
    # a chat completion (one assistant message) is scored on its text
    assert tg.gsm8k_correct_reward([[{"role": "assistant", "content": completion}]], answer=[reference]) == [
        float(correct)]


def test_gsm8k_format_reward_is_a_final_strict_match_and_every_shipped_answer_scores_itself():
    # 1.0 iff the completion ends, whitespace aside, with '#### N' as the strict match reads it
    completions = ["work\n#### 12", "#### 12 and then more words", "so\n#### 7.", "so\n#### 7..", "#### 1,234\n  ",
                   "####12", "#### $18", "#### -3", "", "12"]
    assert tg.gsm8k_format_reward(completions, answer=["#### 12"] * len(completions)) == [
        1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # '#### 7.' is right and well formed; '#### 7..' is well formed, but its N '7.' is not 7
    assert tg.gsm8k_correct_reward(["so\n#### 7.", "so\n#### 7.."], answer=["#### 7"] * 2) == [1.0, 0.0]
    # every shipped sample's worked answer, as a completion, is well formed and right, and so is its bare N
    rows = [json.loads(l) for l in open(SAMPLE)]
    answers = [r["answer"] for r in rows]
    assert len(rows) >= 30 and all(a.count("#### ") == 1 for a in answers)
    assert tg.gsm8k_format_reward(answers) == [1.0] * len(rows)
    assert tg.gsm8k_correct_reward(answers, answer=answers) == [1.0] * len(rows)
    bare = ["#### " + a.split("#### ")[1] for a in answers]
    assert tg.gsm8k_correct_reward(bare, answer=answers) == [1.0] * len(rows)


# ---- the hub path on local things ----
def test_two_rank_run_on_saved_model_and_gsm8k_file():
    tmp_path = two_rank_runs() / "gsm8k"
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in rows)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert AutoTokenizer.from_pretrained(tmp_path / "checkpoint-2").chat_template == CHAT_TEMPLATE


def test_moe_checkpoint_and_bf16(tmp_path):
    moe_dir = save_tiny(tmp_path / "moe", moe=True)
    tg.main([*REAL, "--model_name_or_path", moe_dir, "--dataset", SAMPLE, *GSM8K_REWARDS, "--max_steps", "1",
             "--use_moe", "1", "--dtype", "bfloat16", "--save_dir", str(tmp_path / "run")])
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert math.isfinite(row["aux_loss"]) and row["aux_loss"] > 0


def test_parquet_file_with_gsm8k_columns(tmp_path, dense_dir):
    import datasets
    rows = [json.loads(l) for l in open(SAMPLE)]
    datasets.Dataset.from_dict({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]}
                               ).to_parquet(str(tmp_path / "data.parquet"))
    tg.main([*REAL, "--model_name_or_path", dense_dir, "--dataset", str(tmp_path / "data.parquet"), *GSM8K_REWARDS,
             "--max_steps", "1", "--save_dir", str(tmp_path / "run")])
    assert [json.loads(l)["step"] for l in open(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_unreachable_hub_dataset_is_one_line(tmp_path, dense_dir):
    from test_cli import one_line_error
    line = one_line_error(run_cli(*REAL, "--model_name_or_path", dense_dir, "--dataset", "someone/no-such-dataset",
                                  "--save_dir", tmp_path))
    assert "someone/no-such-dataset" in line


def test_use_moe_with_dense_checkpoint_is_one_line(tmp_path, dense_dir, capsys):
    from test_cli import in_process, one_line_error
    line = one_line_error(in_process(capsys, *REAL, "--model_name_or_path", dense_dir, "--dataset", SAMPLE,
                                     *GSM8K_REWARDS, "--use_moe", "1", "--save_dir", tmp_path))
    assert "dense" in line


@pytest.mark.parametrize("content, words", [("", "empty"), ('{"q": "x", "a": "#### 1"}\n', "question, answer")])
def test_bad_dataset_is_one_line(tmp_path, dense_dir, capsys, content, words):
    from test_cli import in_process, one_line_error
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    line = one_line_error(in_process(capsys, *REAL, "--model_name_or_path", dense_dir, "--dataset", path,
                                     "--save_dir", tmp_path))
    assert words in line


def test_long_prompts_are_left_truncated_and_counted(tmp_path, capsys):
    tg.main([*FAST, "--max_steps", "2", "--max_prompt_len", "3", "--save_dir", str(tmp_path)])
    out = capsys.readouterr()
    assert (out.out + out.err).count("lose their start") == 1  # warned once
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["prompts_cut"] for r in rows] == [4, 4]  # each step: every prompt of its 4


# ---- checkpoints and exact resume ----
TIMING = {"step_time", "generate_time", "tokens_per_s", "peak_mem_gib"}  # measured, not computed


def load_final(d):
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "final", "model.safetensors"))


_ONE_RANK = {}


def one_rank_resume(dtype, moe):
    """Straight to step 4 in a/, and in b/ a stop after step 2 then a resume, in this process, once a session."""
    if (dtype, moe) not in _ONE_RANK:
        where = tempfile.mkdtemp(prefix=f"resume_{dtype}_{moe}_")
        atexit.register(shutil.rmtree, where, ignore_errors=True)
        common = [*RESUME, "--dtype", dtype, "--use_moe", str(moe)]
        tg.main([*common, "--save_dir", os.path.join(where, "a")])
        tg.main([*common, "--stop_after", "2", "--save_dir", os.path.join(where, "b")])
        with open(os.path.join(where, "b.after.json"), "w") as f:
            json.dump({"final": os.path.isdir(os.path.join(where, "b", "final"))}, f)
        tg.main([*common, "--resume", "auto", "--save_dir", os.path.join(where, "b")])
        _ONE_RANK[dtype, moe] = where
    from pathlib import Path
    return Path(_ONE_RANK[dtype, moe])


def assert_continues_exactly(a, b, nproc):
    """b (stopped after step 2, resumed) ends with a's weights, and logs a's steps 3 and 4."""
    wa, wb = load_final(a), load_final(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ma = [json.loads(l) for l in open(a / "metrics.jsonl")]
    mb = [json.loads(l) for l in open(b / "metrics.jsonl")]
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    assert all(r["prompts_cut"] == 4 * nproc for r in mb)    # this step's, over all ranks
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}
    assert [strip(r) for r in ma[2:]] == [strip(r) for r in mb[2:]]


@pytest.mark.parametrize("nproc, dtype, moe", [(1, "float32", 0), (1, "bfloat16", 1),
                                               *((2, dtype, moe) for dtype, moe in RESUME_2_RANKS)])
def test_resume_continues_exactly(nproc, dtype, moe):
    # MoE too: transformers saves its fused experts one tensor per expert, and resume must read them back
    where = two_rank_runs() / f"resume_{dtype}_{moe}" if nproc == 2 else one_rank_resume(dtype, moe)
    assert json.load(open(where / "b.after.json")) == {"final": False}      # a stop leaves no final/
    assert_continues_exactly(where / "a", where / "b", nproc)


def test_resume_reads_a_checkpoint_that_save_pretrained_sharded(tmp_path):
    from transformers import AutoModelForCausalLM
    where = one_rank_resume("float32", 0)
    ckpt = tmp_path / "c" / "checkpoint-2"
    shutil.copytree(where / "b" / "checkpoint-2", ckpt)        # the trainer state and RNG of a real stop
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    os.remove(ckpt / "model.safetensors")
    model.save_pretrained(ckpt, max_shard_size="20KB")         # the same weights in many files and an index
    shards = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in os.listdir(ckpt)
    tg.main([*RESUME, "--dtype", "float32", "--use_moe", "0", "--resume", "auto", "--save_dir", str(tmp_path / "c")])
    wa, wc = load_final(where / "a"), load_final(tmp_path / "c")
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)
    ma = [json.loads(l) for l in open(where / "a" / "metrics.jsonl")]
    mc = [json.loads(l) for l in open(tmp_path / "c" / "metrics.jsonl")]
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}
    assert [strip(r) for r in mc] == [strip(r) for r in ma[2:]]   # steps 3 and 4, as the unsharded resume


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    model, tok = tiny()
    args = tg.parse_args([*FAST, "--save_dir", str(tmp_path)])
    optimizer, scheduler = tg.build_optimizer(model, args)
    trainer = make_run(model, tok, optimizer, scheduler=scheduler)
    tg.save(args, trainer, tg.TrainState(step=1), 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(tg.torch, "save", broken)
    with pytest.raises(OSError):
        tg.save(args, trainer, tg.TrainState(step=2), 0)
    monkeypatch.undo()
    assert tg.find_checkpoint(str(tmp_path)).endswith("checkpoint-1")
    fresh, _ = tiny()
    tg.load_weights(fresh, tg.find_checkpoint(str(tmp_path)))
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)
    assert torch.load(tmp_path / "checkpoint-1" / "trainer_state.pt", weights_only=True)["step"] == 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-1")


def test_resume_of_another_model_shape_is_one_line(tmp_path, capsys):
    from test_cli import in_process, one_line_error
    tg.main([*FAST, "--max_steps", "1", "--save_dir", str(tmp_path)])
    line = one_line_error(in_process(capsys, *FAST, "--max_steps", "2", "--use_moe", "1", "--resume", "auto",
                                     "--save_dir", tmp_path))
    assert "--use_moe 1 differs from 0" in line
    assert (tmp_path / "checkpoint-1" / "model.safetensors").exists()  # nothing already saved is lost


def test_resume_from_a_final_directory_is_one_line(tmp_path, capsys):
    # final/ holds weights but no trainer state: refused naming the missing file, no traceback
    from test_cli import in_process, one_line_error
    tg.main([*FAST, "--max_steps", "1", "--save_dir", str(tmp_path)])
    line = one_line_error(in_process(capsys, *FAST, "--max_steps", "2", "--resume", tmp_path / "final",
                                     "--save_dir", tmp_path / "b"))
    assert "is not a run this train_grpo.py can continue" in line and "trainer_state.pt" in line


# ---- failures inside the loop ----
def test_your_reward_that_raises_is_pythons_traceback_to_your_line_with_a_note_naming_it(tmp_path):
    """A reward is your code: its error is Python's own, exit status 1 and the traceback down to your file's line,
    and a note under the error names the function and the samples it was called on."""
    (tmp_path / "mine.py").write_text("CALLS = []\n"
                                      "\n"
                                      "\n"
                                      "def boom(completions, **kwargs):\n"
                                      "    CALLS.append(1)\n"
                                      "    if len(CALLS) == 2:\n"
                                      "        raise ValueError('no score')\n"
                                      "    return [0.0] * len(completions)\n")
    res = run_cli(*FAST, "--max_steps", "3", "--reward_funcs", f"{tmp_path / 'mine.py'}:boom",
                  "--save_dir", tmp_path / "run")
    assert res.returncode == 1
    lines = res.stderr.splitlines()
    first = [i for i, l in enumerate(lines) if l.startswith("Traceback (most recent call last):")]
    assert len(first) == 1 and not [l for l in lines if l.startswith("error:")], res.stderr[-3000:]
    after = "\n".join(lines[first[0]:])
    assert f'File "{tmp_path / "mine.py"}", line 7, in boom' in after
    # the step's 4 prompts x 4 completions (FAST); the error line, then its note
    assert lines[-2:] == ["ValueError: no score", "in reward function boom, called by train_grpo.py on 16 samples"]
    # it raised at the second call, step 2: step 1 is logged, and no step after it
    assert [json.loads(l)["step"] for l in open(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_a_reward_not_finite_names_the_function_and_sample_and_one_float_cannot_read_is_floats_error(tmp_path,
                                                                                                      monkeypatch):
    """NaN and infinity stop the run in one line naming the function and the sample; a value float() cannot read
    stops it with float()'s own error; None means "does not apply" (TRL's meaning)."""
    for n, (bad_value, error, shown) in enumerate((
            (float("nan"), tg.TrainerError, "^reward bad returned nan for sample 2, not a finite number$"),
            (float("inf"), tg.TrainerError, "^reward bad returned inf for sample 2, not a finite number$"),
            # float() of a text that is no number, of a list, of an int too large for a float, of 2 values
            ("good", ValueError, "^could not convert string to float: 'good'"),
            ([0.5], TypeError, "^float\\(\\) argument must be a string or a real number, not 'list'"),
            (10**400, OverflowError, "^int too large to convert to float"),
            (torch.tensor([1.0, 2.0]), ValueError, "^only one element tensors can be converted to Python scalars"),
            # None: the only reward, so nothing scores sample 2
            (None, tg.TrainerError, "^every reward function returned None for sample 2 "))):
        def bad(completions, answer, **kwargs):
            return [0.5, 0.5, bad_value] + [0.5] * (len(completions) - 3)   # the third sample is bad
        monkeypatch.setattr(tg, "reverse_reward", bad)
        with pytest.raises(error, match=shown):
            tg.main(FAST + ["--max_steps", "1", "--save_dir", str(tmp_path / f"run{n}")])   # a fresh start each


def test_non_finite_steps_are_skipped_and_counted(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    calls = [0]
    real = tg.compute_advantages

    def nan_after_two_steps(*a, **kw):  # a loss that is not finite from the third step on
        calls[0] += 1
        return real(*a, **kw) * (1.0 if calls[0] <= 2 else float("nan"))
    monkeypatch.setattr(tg, "compute_advantages", nan_after_two_steps)
    tg.main(FAST + ["--max_steps", "4", "--save_interval", "1", "--save_dir", str(tmp_path)])
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["skipped_updates"] for r in rows] == [0, 0, 1, 2]
    # steps 3 and 4 updated nothing: the run ends with step 2's weights, every one finite
    two, final = load_file(tmp_path / "checkpoint-2" / "model.safetensors"), load_final(tmp_path)
    assert two.keys() == final.keys() and all(torch.equal(two[k], final[k]) for k in two)
    assert all(torch.isfinite(w).all() for w in final.values())
    one = load_file(tmp_path / "checkpoint-1" / "model.safetensors")
    assert any(not torch.equal(one[k], two[k]) for k in two)               # step 2 did update
