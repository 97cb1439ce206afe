"""Your own task without editing the trainer: reward functions from a file, 'prompt' datasets (text or chat
messages) whose other columns reach the rewards, wandb / TensorBoard logging, the closing summary."""
import glob
import json
import os
import time

import pytest

from helpers import rewards_of_functions, tg
from test_real_path import CHAT_TEMPLATE, one_thread, save_tiny  # noqa: F401  (one_thread: autouse)

REAL = ["--batch_size", "2", "--num_generations", "2", "--max_gen_len", "6", "--eval_interval", "0"]

REWARD_FILE = '''
import json, os
LOG = os.environ["REWARD_LOG"]

def length_reward(prompts, completions, target_len, topic, **kwargs):
    """Closer to the row's target_len is better; records what it was given, one line per sample."""
    with open(LOG, "a") as f:
        for p, c, n, t in zip(prompts, completions, target_len, topic):
            f.write(json.dumps({"completion": c, "target_len": n, "prompt": p, "topic": t}) + "\\n")
    return [-abs(len(c) - n) for c, n in zip(completions, target_len)]


def topic_seen(completions, topic, **kwargs):
    with open(LOG + ".topics", "a") as f:
        f.write("".join(t + "\\n" for t in topic))
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_reward_file_and_prompt_dataset_with_extra_columns(tmp_path, model_dir, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    rows = [{"prompt": f"Say {n} letters:", "target_len": n, "topic": f"t{n}"} for n in range(1, 9)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    tg.main(REAL + ["--model_name_or_path", model_dir, "--dataset", data, "--max_steps", "3",
                    "--reward_funcs", f"{tmp_path / 'my_rewards.py'}:length_reward,{tmp_path / 'my_rewards.py'}:topic_seen",
                    "--reward_weights", "1,1", "--save_dir", str(tmp_path / "run")])
    calls = [json.loads(l) for l in open(tmp_path / "calls.jsonl")]
    assert open(tmp_path / "calls.jsonl.topics").read().split() == [c["topic"] for c in calls]
    assert len(calls) == 3 * 2 * 2                                            # steps x prompts x completions
    by_prompt = {r["prompt"]: r for r in rows}                                # a text prompt is used as is
    for c in calls:
        assert c["target_len"] == by_prompt[c["prompt"]]["target_len"] and c["topic"] == by_prompt[c["prompt"]]["topic"]
    logged = [json.loads(l)["reward"] for l in open(tmp_path / "run" / "metrics.jsonl")]
    per_step = [[-abs(len(c["completion"]) - c["target_len"]) for c in calls[4 * s:4 * s + 4]] for s in range(3)]
    assert logged == pytest.approx([sum(r) / 4 for r in per_step])


def test_chat_prompts_render_with_a_new_assistant_turn_and_rewards_get_the_messages(tmp_path, model_dir,
                                                                                     monkeypatch):
    """As TRL 1.16: every chat prompt goes through the template with add_generation_prompt, one ending with an
    assistant message too (a new assistant turn follows it); the rewards, in the step and in the held-out eval,
    get the dataset's prompt unchanged (its messages, that last one included) and each completion as one
    assistant message."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    ask = lambda n: [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count to {n}."}]
    # row 0 ends with the user message, every other row with an assistant message
    rows = [{"prompt": ask(n) + ([{"role": "assistant", "content": "<think>"}] if n else [])} for n in range(20)]
    rendered, generated = [], []
    real_tokenize, real_rollout = tg.tokenize_prompts, tg.rollout
    monkeypatch.setattr(tg, "tokenize_prompts", lambda t, texts, *a, **k: rendered.append(list(texts))
                        or real_tokenize(t, texts, *a, **k))
    monkeypatch.setattr(tg, "rollout", lambda *a, **k: generated.append(real_rollout(*a, **k)) or generated[-1])
    calls = []
    monkeypatch.setattr(tg, "gsm8k_format_reward", lambda prompts, completions, **kw: calls.append(
        (prompts, completions)) or [0.0] * len(completions))
    tg.main(REAL + ["--model_name_or_path", model_dir, "--dataset", write_jsonl(tmp_path / "chat.jsonl", rows),
                    "--max_steps", "1", "--eval_interval", "1", "--reward_funcs", "gsm8k_format_reward",
                    "--save_dir", str(tmp_path / "run")])
    # the template by hand: <|role|>\ncontent\n per message, then the generation prompt, after an assistant too
    by_hand = lambda messages: "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
    assert CHAT_TEMPLATE.startswith("{% for m in messages %}<|{{ m['role'] }}|>")  # the template this assumes
    # eval (2 held-out rows: the first tenth), the step (2 prompts x 2), eval again
    assert [len(c[0]) for c in calls] == [2, 4, 2] and len(rendered) == len(generated) == 3
    assert [p[-1]["role"] for p in calls[0][0]] == ["user", "assistant"]            # held out: rows 0 and 1
    G = [1, 2, 1]                                                                   # the eval has one row a prompt
    for (prompts, completions), texts, (comp, mask, _), g in zip(calls, rendered, generated, G):
        assert all(p in [r["prompt"] for r in rows] for p in prompts)              # the dataset's messages, whole
        assert texts == [by_hand(p) for p in prompts[::g]]                         # what the policy read
        decoded = [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(comp, mask)]
        assert completions == [[{"role": "assistant", "content": t}] for t in decoded]


def test_a_chat_message_without_role_or_content_is_one_line(tmp_path, model_dir, capsys):
    rows = [{"prompt": [{"role": "user", "content": f"Count to {n}."}]} for n in range(4)]
    rows[1]["prompt"] = [{"text": "Count to 1."}]                                   # no role, no content
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    status = tg.cli(REAL + ["--model_name_or_path", model_dir, "--dataset", data, "--max_steps", "1",
                            "--batch_size", "4", "--reward_funcs", "gsm8k_format_reward",
                            "--save_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert status == 1 and "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert "'role' and 'content'" in lines[0]


@pytest.mark.parametrize("content, words", [
    ("def length_reward(completions:\n", "importing"),                       # a syntax error
    ("def other(completions, **kw): return [1.0] * len(completions)\n", "no function 'length_reward'"),
])
def test_broken_reward_file_is_one_line(tmp_path, model_dir, capsys, content, words):
    (tmp_path / "r.py").write_text(content)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    status = tg.cli(REAL + ["--model_name_or_path", model_dir, "--dataset", data, "--max_steps", "1",
                            "--reward_funcs", f"{tmp_path / 'r.py'}:length_reward", "--save_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert status == 1 and len(lines) == 1 and words in lines[0] and "length_reward" in lines[0], err[-2000:]


@pytest.mark.parametrize("content, error, words, note", [
    # text is no reward: float() refuses it, and its own error leaves the run
    ("def length_reward(completions, **kw): return ['good'] * len(completions)\n", ValueError,
     "could not convert string to float: 'good'", False),
    # a function that cannot take the call's arguments: Python's TypeError, with a note that names the function
    ("def length_reward(prompts, completions): return [1.0] * len(completions)\n", TypeError,
     "got an unexpected keyword argument 'completion_ids'", True),
])
def test_a_reward_file_that_loads_but_cannot_score_raises_pythons_own_error(tmp_path, model_dir, capsys, content,
                                                                           error, words, note):
    (tmp_path / "r.py").write_text(content)
    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"p{i}"} for i in range(4)])
    with pytest.raises(error, match=words) as e:
        tg.cli(REAL + ["--model_name_or_path", model_dir, "--dataset", data, "--max_steps", "1",
                       "--reward_funcs", f"{tmp_path / 'r.py'}:length_reward", "--save_dir", str(tmp_path / "run")])
    if note:   # the first call, at step 1: 2 prompts x 2 completions (REAL)
        assert e.value.__notes__ == ["in reward function length_reward, called by train_grpo.py on 4 samples"]
    assert "error:" not in capsys.readouterr().err


def wandb_records(run_file):
    """The protobuf Records of an offline wandb run file (a LevelDB-style log), in order."""
    from wandb.proto.wandb_internal_pb2 import Record
    data, pos, pending, records = open(run_file, "rb").read(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:                                              # block trailer: zero padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):                                                      # FULL, or LAST of a split record
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            records.append(record)
    return records


def wandb_history(run_file):
    """The 'history' records of an offline wandb run file: {key: value} each."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for record in wandb_records(run_file) if record.WhichOneof("record_type") == "history"]


def wandb_rewards(run_file, steps, timeout=60):
    """The history records with a reward. In this process wandb's writer may still be flushing the run file
    when finish() returns: wait for `steps` records, then read them."""
    deadline = time.time() + timeout
    while True:
        try:
            history = [h for h in wandb_history(run_file) if "reward" in h]
        except Exception:              # a record half written: read again, unless time is up
            if time.time() > deadline:
                raise
            history = []
        if len(history) >= steps or time.time() > deadline:
            return history
        time.sleep(0.2)


def test_wandb_offline_run_holds_the_logged_rewards(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tg.main(["--batch_size", "4", "--num_generations", "4", "--max_gen_len", "6", "--sft_warmup_steps", "0",
             "--eval_interval", "0", "--max_steps", "3", "--report_to", "wandb", "--save_dir", str(tmp_path)])
    logged = [json.loads(l)["reward"] for l in open(tmp_path / "metrics.jsonl")]
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_rewards(run_file, steps=3)
    assert [h["reward"] for h in history] == pytest.approx(logged)
    assert [h["_step"] for h in history] == [1, 2, 3]


def test_tensorboard_events_hold_the_logged_rewards(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator  # requirements-test.txt only
    tg.main(["--batch_size", "4", "--num_generations", "4", "--max_gen_len", "6", "--sft_warmup_steps", "0",
             "--eval_interval", "0", "--max_steps", "3", "--report_to", "tensorboard", "--run_name", "tb",
             "--save_dir", str(tmp_path)])
    logged = [json.loads(l)["reward"] for l in open(tmp_path / "metrics.jsonl")]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "tb"))
    acc.Reload()
    events = acc.Scalars("reward")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx(logged, rel=1e-6)        # stored as float32


def test_missing_report_package_is_one_line(tmp_path, capsys, monkeypatch):
    real = tg.importlib.util.find_spec
    monkeypatch.setattr(tg.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit):
        tg.cli(["--report_to", "wandb", "--save_dir", str(tmp_path / "run")])
    assert "--report_to wandb: the package is not installed" in capsys.readouterr().err


def test_summary_line_and_eval_size_caps_a_test_split(tmp_path, model_dir, capsys, monkeypatch):
    """The run's last line gives the held-out score at the first eval, at its best and at the last, with their
    steps, and where the model is. --eval_size takes 5 rows of a hub dataset's own test split."""
    import datasets
    rows = [json.loads(l) for l in open(os.path.join(os.path.dirname(__file__), "data", "gsm8k_sample.jsonl"))]
    split = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:24]),
                                  "test": datasets.Dataset.from_list(rows[8:])})   # a hub dataset's two splits
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: split)
    scored, evals_done = [], [0]
    real, real_eval, evaluating = tg.gsm8k_correct_reward, tg.evaluate, []

    def evaluate(*a, **k):   # the held-out rows are scored by the rewards, called in evaluate
        evaluating.append(1)
        try:
            return real_eval(*a, **k)
        finally:
            evaluating.pop()
            evals_done[0] += 1
    monkeypatch.setattr(tg, "evaluate", evaluate)

    def gsm8k_correct_reward(completions, answer, **kw):   # TRL's batched form, under the real one's name
        if evaluating:
            scored.extend(answer)
        return real(completions, answer, **kw)

    def gsm8k_format_reward(completions, **kw):
        # at the evals of steps 0, 1 and 2: 0.0, 0.5 and 0.25 each row, so that the first, best and last differ
        return [[0.0, 0.5, 0.25][evals_done[0]] if evaluating else 0.0 for _ in completions]
    monkeypatch.setattr(tg, "gsm8k_correct_reward", gsm8k_correct_reward)
    monkeypatch.setattr(tg, "gsm8k_format_reward", gsm8k_format_reward)
    tg.main(REAL + ["--model_name_or_path", model_dir, "--dataset", "someone/gsm8k-like", "--max_steps", "2",
                    "--reward_funcs", "gsm8k_correct_reward,gsm8k_format_reward",
                    "--eval_interval", "1", "--eval_size", "5", "--save_dir", str(tmp_path)])
    assert len(scored) == 3 * 5                                   # steps 0, 1 and 2, 5 of the 24 test problems
    out = capsys.readouterr().out
    evals = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if "eval_reward" in l]
    assert [e["step"] for e in evals] == [0, 1, 2]
    # your rewards, weight 1 each: the score is each row's correctness (0 for this untrained model) + format
    score = [e["eval_reward"] for e in evals]
    assert score == [0.0, 0.5, 0.25]
    line = [l for l in out.splitlines() if l.startswith("done:")]
    assert line == [f"done: step 2 of 2 in {line[0].split(' in ')[1].split(' s;')[0]} s; held-out eval_reward "
                    f"{score[0]:.3f} (step 0), best {score[1]:.3f} (step 1), last {score[2]:.3f} (step 2); "
                    f"model: {tmp_path / 'final'}"]
    assert line[0].split(" in ")[1].split(" s;")[0].isdigit()


def test_a_dataset_column_may_be_named_like_the_callers_own_argument():
    """Columns reach reward functions as the dataset has them, whatever their names (`fn` included)."""
    def batched(completions, fn, **kwargs):
        return [float(x) for x in fn]
    rows = [{"prompt": "p", "answer": "a", "fn": 2}]
    assert rewards_of_functions([batched], [1.0], ["p"], ["c"], [[1]], rows).tolist() == [2.0]
    # ... but a column named like one of TRL's own arguments is Python's TypeError naming it, as in TRL (never
    # overwritten), with a note naming the function
    with pytest.raises(TypeError, match="multiple values for keyword argument 'prompts'") as e:
        rewards_of_functions([batched], [1.0], ["p"], ["c"], [[1]], [{"prompt": "p", "prompts": "x", "fn": 1}])
    assert e.value.__notes__ == ["in reward function batched, called by train_grpo.py on 1 samples"]



def test_columns_named_completion_or_completion_ids_are_left_out_as_in_trl():
    """The call passes the generated completions and their ids itself; a dataset's own columns of those names
    would collide with them, so they never reach the function (TRL leaves out the same three keys)."""
    seen = {}

    def record(prompts, completions, completion_ids, **columns):
        seen.update(completions=completions, completion_ids=completion_ids, columns=sorted(columns))
        return [1.0]
    rows = [{"prompt": "p", "completion": "from the dataset", "completion_ids": [9, 9], "answer": "a"}]
    assert rewards_of_functions([record], [1.0], ["p"], ["generated"], [[4, 5]], rows).tolist() == [1.0]
    assert seen == {"completions": ["generated"], "completion_ids": [[4, 5]], "columns": ["answer"]}


def test_a_reward_that_edits_a_column_changes_neither_the_rows_nor_the_other_samples():
    """A group's G samples are one training row repeated; a reward gets copies of its columns (TRL reads each
    sample afresh from the dataset), so an edit never reaches the next sample, the next step or the rows."""
    seen = []

    def edits(completions, meta, **kwargs):
        seen.append([list(m["tags"]) for m in meta])
        for m in meta:
            m["tags"].append("edited")              # an edit one level down, which a shallow copy would share
        return [0.0] * len(completions)
    row = {"prompt": "p", "meta": {"tags": ["a"]}}
    rows = [row, row]                                   # G = 2 samples of one row, as grpo_step repeats it
    for _ in range(2):
        rewards_of_functions([edits], [1.0], ["p", "p"], ["x", "y"], [[1], [2]], rows)
    assert seen == [[["a"], ["a"]], [["a"], ["a"]]]
    assert row == {"prompt": "p", "meta": {"tags": ["a"]}}

def test_a_bare_reward_name_is_one_of_this_files_reward_functions_only():
    assert tg.load_reward_funcs("gsm8k_format_reward") == [tg.gsm8k_format_reward]
    with pytest.raises(tg.TrainerError, match="--reward_funcs main: no function 'main'"):
        tg.load_reward_funcs("main")  # a function of train_grpo.py, but not a reward
