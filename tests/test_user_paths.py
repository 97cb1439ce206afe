"""The paths a user takes with a real checkpoint and their own data: the bf16 reference, eval with uneven ranks,
test-only datasets, rows as the dataset has them, reward weights, bad reward values, every EOS id, loggers
after a resume, flag combinations that cannot work."""
import json
import re

import pytest
import torch

from helpers import FAST, tg, tiny
from test_real_path import (BF16_KL, GSM8K_REWARDS, REAL, one_thread, save_tiny,  # noqa: F401  (one_thread: autouse)
                            two_rank_runs)


# ---- 1. the reference computes what the policy computes ----
def test_bf16_reference_is_the_starting_policy_at_step_1_single_and_ddp(tmp_path):
    tg.main([*BF16_KL, "--save_dir", str(tmp_path / "one")])
    for run in (tmp_path / "one", two_rank_runs() / "bf16_kl"):      # one process; 2 ranks under DDP
        row = json.loads(open(run / "metrics.jsonl").readline())
        assert row["kl"] == 0.0, (run, row["kl"])


def test_reference_keeps_fp32_where_the_policy_does_and_matches_its_log_probs():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    # head_dim 128 and rope_theta 1e6 as in Qwen: a bf16 inv_freq would turn position 1,000 by ~1 rad
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=128,
                                         rope_theta=1e6, max_position_embeddings=2048, tie_word_embeddings=False))
    ref = tg.frozen_copy(model, torch.bfloat16)
    inv_freq = dict(ref.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, dict(model.named_buffers())["model.rotary_emb.inv_freq"])
    assert ref.model.embed_tokens.weight.dtype == ref.model.norm.weight.dtype == torch.float32
    assert ref.lm_head.weight.dtype == torch.bfloat16                       # what autocast reads: 2 bytes each
    ids = torch.randint(0, 64, (2, 1100))
    am = torch.ones_like(ids)
    args = tg.Args(dtype="bfloat16")
    with torch.no_grad(), tg.autocast(args, "cpu"):
        want = tg.completion_logps(model, ids, am, 50)[0]
        got = tg.completion_logps(ref, ids, am, 50)[0]
    assert torch.equal(got, want)
    # a tied head stays tied to its fp32 embedding
    tied, _ = tiny()
    ref = tg.frozen_copy(tied, torch.bfloat16)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight and ref.lm_head.weight.dtype == torch.float32


# ---- 2. eval: every held-out row once, whatever the ranks ----
def test_eval_scores_each_held_out_row_once_whatever_the_ranks():
    seen = [torch.load(two_rank_runs() / f"eval_{r}.pt") for r in (0, 1)]   # dist_workers.eval_uneven
    assert seen[0] == seen[1]                                                 # one world number
    assert seen[0]["scored"] == sorted(range(5))                              # rows 0..4, once each
    assert seen[0]["accuracy"] == pytest.approx(sum(range(5)) / 5)


# ---- 4. held out means held out ----
def test_a_test_only_dataset_is_split_disjointly(tmp_path):
    import datasets
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(40)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "test-00000-of-00001.parquet"))
    train, held_out = tg.load_rows(tg.Args(dataset=str(tmp_path / "test-00000-of-00001.parquet"), eval_size=4,
                                           model_name_or_path="m"))
    # a test-only set through load_dataset's own split name
    splits = datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
    real = datasets.load_dataset
    try:
        datasets.load_dataset = lambda *a, **k: splits
        train2, held_out2 = tg.load_rows(tg.Args(dataset="someone/test-only", eval_size=4, model_name_or_path="m"))
    finally:
        datasets.load_dataset = real
    for tr, ev in ((train, held_out), (train2, held_out2)):
        questions = {r["question"] for r in tr}
        assert len(ev) == 4 and len(tr) == 36 and not questions & {r["question"] for r in ev}


def test_gsm8k_loads_the_hub_dataset_even_beside_a_folder_named_gsm8k_and_a_folder_is_refused(tmp_path, monkeypatch):
    import datasets
    (tmp_path / "gsm8k").mkdir()                     # e.g. a run's --save_dir gsm8k
    monkeypatch.chdir(tmp_path)
    asked = []
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(20)]

    def load_dataset(*names, **kwargs):
        asked.append(names)
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    train, _ = tg.load_rows(tg.Args(dataset="gsm8k", model_name_or_path="m", eval_size=2))
    assert asked == [("openai/gsm8k", "main")] and len(train) == 18
    with pytest.raises(tg.TrainerError, match="is a folder"):
        tg.load_rows(tg.Args(dataset=str(tmp_path / "gsm8k"), model_name_or_path="m"))
    assert len(asked) == 1

# ---- 5-6. rows as the dataset has them; your rewards weigh 1.0 each ----
def test_rows_reach_rewards_as_the_dataset_has_them_and_your_rewards_weigh_one_each(tmp_path):
    model_dir = save_tiny(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i, "gold": [i, "x"], "answer2": f"{i}"}) + "\n"
                            for i in range(4)))
    log = tmp_path / "calls.jsonl"
    (tmp_path / "r.py").write_text(
        "import json\n"
        "def seen(completions, answer, gold, answer2, **kwargs):\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        for row in zip(answer, gold, answer2):\n"
        "            f.write(json.dumps({k: [type(v).__name__, v] for k, v in zip(['answer', 'gold', 'answer2'], row)})"
        " + '\\n')\n"
        "    return [1.0] * len(completions)\n"
        "def two(completions, **kwargs):\n    return [2.0] * len(completions)\n")
    tg.main([*REAL, "--model_name_or_path", model_dir, "--dataset", str(data),
             "--reward_funcs", f"{tmp_path / 'r.py'}:seen,{tmp_path / 'r.py'}:two", "--max_steps", "1",
             "--save_dir", str(tmp_path / "run")])
    calls = [json.loads(l) for l in open(log)]
    assert calls and all(c["answer"][0] == "int" and c["gold"][0] == "list" and c["answer2"][0] == "str"
                         for c in calls)
    assert all(c["answer"][1] == int(c["answer2"][1]) for c in calls)
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["reward"] == 1.0 * 1.0 + 1.0 * 2.0                    # weights 1.0 each, not [1, 0.1]


def test_built_in_tasks_keep_their_own_weights():
    assert tg.task_rewards(tg.Args())[1] == [1.0]
    assert tg.task_rewards(tg.Args(dataset="gsm8k"))[1] == [1.0, 0.1]
    assert tg.task_rewards(tg.Args(dataset="compare_numbers"))[1] == [1.0, 0.5]


# ---- 8. every EOS id the checkpoint declares ----
def test_generation_stops_and_the_mask_ends_on_every_declared_eos_id():
    model, tok = tiny(seed=3)
    prompts = ["abc=", "hgfedcba=", "ba=", "cabde="]
    ids, am, _ = tg.tokenize_prompts(tok, prompts, 64, "cpu")
    comp, mask, *_ = tg.rollout(model, ids, am, tok, max_gen_len=8, do_sample=False)
    # a token the greedy model emits mid-completion becomes a second EOS, declared only by the checkpoint
    row = next(i for i in range(len(prompts)) if mask[i, 2] == 1 and comp[i, 2] != tok.eos_token_id)
    other = comp[row, 2].item()
    assert other != tok.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    comp2, mask2, truncated2 = tg.rollout(model, ids, am, tok, max_gen_len=8, do_sample=False)
    for i in range(len(prompts)):  # each row: the old tokens up to the first of either EOS, then nothing
        ends = [t for t in range(comp.shape[1]) if comp[i, t].item() in (tok.eos_token_id, other)]
        stop = ends[0] if ends else comp.shape[1] - 1
        assert comp2[i, :stop + 1].tolist() == comp[i, :stop + 1].tolist()
        assert mask2[i].tolist() == [1] * (stop + 1) + [0] * (comp2.shape[1] - stop - 1)
        assert bool(truncated2[i]) == (not ends)
    assert tg.eos_token_ids(model, tok) == sorted({tok.eos_token_id, other})


# ---- 9. loggers after a resume ----
def test_tensorboard_after_a_resume_holds_each_step_once_with_the_resumed_values(tmp_path, monkeypatch):
    """Killed after logging step 3, before its checkpoint, then resumed from step 2: TensorBoard drops the killed
    run's step 3 (logged here 100 higher, as a history that differs) and holds each step once, as metrics.jsonl."""
    from tensorboard.backend.event_processing import event_accumulator
    common = [*FAST, "--max_steps", "4", "--report_to", "tensorboard", "--run_name", "tb", "--save_interval", "2",
              "--save_dir", str(tmp_path)]
    real = tg.log_step

    def killed_after_step_3(args, record, *a, **k):
        if record["step"] == 3:
            record = {**record, "reward": record["reward"] + 100}
        real(args, record, *a, **k)
        if record["step"] == 3:
            raise KeyboardInterrupt("killed")
    monkeypatch.setattr(tg, "log_step", killed_after_step_3)
    with pytest.raises(KeyboardInterrupt):
        tg.main(common)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "tb"))
    acc.Reload()
    killed = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [e.step for e in acc.Scalars("reward")] == [r["step"] for r in killed] == [1, 2, 3]
    assert acc.Scalars("reward")[2].value == pytest.approx(killed[2]["reward"], rel=1e-6) and killed[2]["reward"] > 99
    tg.main(common + ["--resume", "auto"])                                 # from the checkpoint of step 2
    logged = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [1, 2, 3, 4] and logged[2]["reward"] < 99
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "tb"))
    acc.Reload()
    events = acc.Scalars("reward")
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert [e.value for e in events] == pytest.approx([r["reward"] for r in logged], rel=1e-6)


def wandb_runs(save_dir, steps):
    """Each offline wandb run in save_dir, oldest first: (its id, its group, the steps it logged). wandb's writer
    may still be flushing a run file of this process: wait until the runs hold `steps` steps in all."""
    import glob
    import time
    from test_custom import wandb_records
    deadline = time.time() + 60
    while True:
        runs = []
        try:
            for run_file in sorted(glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
                records = wandb_records(run_file)
                (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
                logged = [json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "history"
                          for i in r.history.item if (i.key or "/".join(i.nested_key)) == "_step"]
                runs.append((run.run_id, run.run_group, logged))
        except Exception:              # a record half written: read again, unless time is up
            if time.time() > deadline:
                raise
            runs = []
        if sum(len(logged) for *_, logged in runs) >= steps or time.time() > deadline:
            return runs
        time.sleep(0.2)


def test_a_wandb_resume_is_a_new_run_of_the_group_unless_wandbs_own_variables_name_the_run(tmp_path, monkeypatch):
    """A resumed run logs to a new wandb run in the run's group (the run name: --save_dir's folder), so wandb
    drops no step it logged before; WANDB_RUN_ID and WANDB_RESUME=allow, set for both commands, reopen the run."""
    from helpers import run_cli
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    common = [*FAST, "--max_steps", "2", "--report_to", "wandb"]
    tg.main([*common, "--stop_after", "1", "--save_dir", str(tmp_path / "new")])
    tg.main([*common, "--resume", "auto", "--save_dir", str(tmp_path / "new")])
    # two runs started within one second: their folders' names do not say which came first, their steps do
    runs = sorted(wandb_runs(tmp_path / "new", steps=2), key=lambda r: r[2])
    (first, group1, steps1), (second, group2, steps2) = runs
    assert first != second and group1 == group2 == "new" and (steps1, steps2) == ([1], [2])
    # wandb reads its variables as it starts, so each command is a process of its own, as a user's is
    monkeypatch.setenv("WANDB_RUN_ID", "myrun123")
    monkeypatch.setenv("WANDB_RESUME", "allow")
    for flags in (["--stop_after", "1"], ["--resume", "auto"]):
        res = run_cli(*common, *flags, "--save_dir", tmp_path / "same", timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted(wandb_runs(tmp_path / "same", steps=2), key=lambda r: r[2])
    assert runs == [("myrun123", "same", [1]), ("myrun123", "same", [2])]


# ---- flags that cannot work together are refused before any work ----
def test_built_in_model_with_a_dataset_is_refused(tmp_path, capsys):
    from test_cli import in_process, one_line_error
    line = one_line_error(in_process(capsys, "--dataset", "gsm8k", "--save_dir", tmp_path / "run"))
    assert "--model_name_or_path and --dataset go together" in line
    assert not (tmp_path / "run").exists()


def test_logged_kl_is_the_masked_mean_over_all_tokens_not_a_mean_of_micro_batch_means(tmp_path):
    # 2 micro-batches with different token counts: the mean of their means differs from the token mean
    tg.main([*FAST, "--max_steps", "2", "--beta", "0.5", "--micro_batch_size", "8", "--learning_rate", "0.05",
             "--save_dir", str(tmp_path)])
    captured = {}
    real = tg.policy_objective

    def spy(logps, old, A, mask, **kw):
        loss, stats = real(logps, old, A, mask, **kw)
        captured.setdefault("parts", []).append((stats["kl_sum"].item() / mask.sum().item(), mask.sum().item()))
        return loss, stats
    tg.policy_objective = spy
    try:
        tg.main([*FAST, "--max_steps", "3", "--beta", "0.5", "--micro_batch_size", "8", "--learning_rate", "0.05",
                 "--resume", str(tmp_path / "checkpoint-2"), "--save_dir", str(tmp_path)])
    finally:
        tg.policy_objective = real
    (m1, n1), (m2, n2) = captured["parts"]
    row = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][-1]
    assert n1 != n2 and m1 != m2
    assert row["kl"] == pytest.approx((m1 * n1 + m2 * n2) / (n1 + n2), rel=1e-5)
    assert abs(row["kl"] - (m1 + m2) / 2) > 1e-3 * abs(row["kl"])


# ---- prompts keep the special tokens the model was trained with ----
def bos_tokenizer():
    """A tokenizer like Llama-3's or Gemma's: tokenizer(text) puts a BOS first, and its chat template writes
    the BOS itself."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>",
                                         *"abc= "])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # BOS first and, like add_eos_token=True, an EOS last: a prompt must get the first and not the second
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                       special_tokens=[("<bos>", 2), ("<eos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left",
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast


def test_a_plain_prompt_gets_its_bos_and_a_templated_one_none_twice():
    tok = bos_tokenizer()
    chat = tg.render_prompt(tok, {"prompt": [{"role": "user", "content": "ab"}]})
    assert chat == "<bos><|user|>ab<|assistant|>"
    ids, am, _ = tg.tokenize_prompts(tok, ["ca=", chat, "cx="], 64, "cpu")
    # by hand: <pad> 0, <bos> 2, <unk> 3, <|user|> 4, <|assistant|> 5, a 6, b 7, c 8, '=' 9; left-padded.
    # "x" is unknown (<unk>, a special id): the prompt is still plain text and gets its BOS
    assert ids.tolist() == [[0, 2, 8, 6, 9], [2, 4, 6, 7, 5], [0, 2, 8, 3, 9]]
    assert am.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]


def test_a_prompt_column_wins_over_a_question_which_gets_gsm8ks_system_prompt(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "question": f"q{i}"}) + "\n" for i in range(20)))
    train, held_out = tg.load_rows(tg.Args(dataset=str(data), eval_size=2, model_name_or_path="m"))
    assert len(train) == 18 and len(held_out) == 2       # a 'prompt' row needs no 'answer'
    data.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(20)))
    with pytest.raises(tg.TrainerError, match="no column answer"):
        tg.load_rows(tg.Args(dataset=str(data), eval_size=2, model_name_or_path="m"))
    tok = bos_tokenizer()
    assert tg.render_prompt(tok, {"prompt": "ab", "question": "ignored"}) == "ab"
    assert tg.reward_prompt({"prompt": "ab", "question": "ignored"}, "rendered") == "ab"
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
    assert tg.render_prompt(tok, {"question": "1 + 1?"}) == f"[system: {tg.GSM8K_SYSTEM_PROMPT}][user: 1 + 1?]"
    assert tg.reward_prompt({"question": "1 + 1?"}, "rendered") == "rendered"


def test_a_cut_prompt_keeps_its_bos_and_loses_content_instead():
    tok = bos_tokenizer()
    chat = "<bos><|user|>abc<|assistant|>"                  # a template that writes the BOS itself
    ids, am, n_cut = tg.tokenize_prompts(tok, ["abcab=", chat, "ba="], 4, "cpu")
    # by hand (<bos> 2, <|user|> 4, <|assistant|> 5, a 6, b 7, c 8, '=' 9): the BOS, then the last 3 tokens
    assert ids.tolist() == [[2, 6, 7, 9], [2, 7, 8, 5], [2, 7, 6, 9]] and am.tolist() == [[1] * 4] * 3
    assert n_cut == 2                                        # "ba=" with its BOS is 4 tokens: not cut
    # a budget of one token keeps the prompt's last token, not a BOS that would make every prompt alike
    assert tg.tokenize_prompts(tok, ["abcab=", "ba="], 1, "cpu")[0].tolist() == [[9], [9]]


def test_compare_numbers_holds_out_questions_never_trained_in_either_order():
    train, held_out = tg.make_compare_task(200)
    pair = lambda r: tuple(int(x) for x in re.findall(r"\d+", r["prompt"][0]["content"]))
    trained = [pair(r) for r in train]
    held = {frozenset(pair(r)) for r in held_out}
    assert len(held_out) == 200 and len(train) == 90 * 89 - 2 * len(held)  # both orders of all others
    assert not held & {frozenset(p) for p in trained}
    assert sorted(trained) == sorted((b, a) for a, b in trained)  # both orders of every trained pair
    assert all(r["answer"] == max(pair(r)) for r in train + held_out)


# ---- no held-out set, no held-out number ----
def test_evaluation_without_held_out_prompts_is_refused_or_said(tmp_path, capsys):
    assert list(tg.check_args(tg.Args(eval_size=0))) == [
        "--eval_interval 50 needs held-out prompts: set --eval_size > 0 or --eval_interval 0"]
    assert list(tg.check_args(tg.Args(eval_size=0, eval_interval=0))) == []
    # a file of 6 rows holds none out (a tenth of it is 0 rows): the run says so and evaluates nothing
    model_dir = tmp_path / "model"
    save_tiny(model_dir)
    with open(tmp_path / "six.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n")
    tg.main([*REAL[:-2], "--eval_interval", "1", "--model_name_or_path", str(model_dir), "--dataset",
             str(tmp_path / "six.jsonl"), *GSM8K_REWARDS, "--max_steps", "1", "--save_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "0 held-out prompts" in out and "no held-out eval" in out
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and not [k for k in rows[0] if k.startswith("eval")]
