"""What a TRL user brings: TRL's batched reward functions (written as TRL's documentation shows them) and GSPO's
sequence ratio (--importance_sampling_level sequence). Every expected value is computed here by hand or by a
plain computation, not by the trainer's functions."""
import json
import math
import re

import pytest
import torch

from helpers import rewards_of_functions, tg
from test_custom import REAL, model_dir, write_jsonl  # noqa: F401  (model_dir: a fixture)


# ---- 1. rewards, TRL's batched form ----
# TRL's documentation, verbatim: a length reward (standard format), a format reward (conversational format)
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def same_length_as_answer(completions, answer, **kwargs):                  # reads a dataset column
    return [float(len(c) == len(a)) for c, a in zip(completions, answer)]


TEXTS = ["ab", "x" * 20, "abcdefgh" * 3, "<think>hm</think><answer>4</answer>", "", "dcba", "dcba", "abc"]
ROWS = [{"prompt": f"p{i // 4}=", "answer": "dcba"} for i in range(8)]       # 2 prompts x G = 4
PROMPTS = [r["prompt"] for r in ROWS]


def rewards_of(fns, weights):
    """compute_rewards as grpo_step calls it: prompts, completions, completion ids, the rows."""
    return rewards_of_functions(fns, weights, PROMPTS, TEXTS, [[1]] * 8, ROWS)


def test_trl_length_reward_beside_another_weighted():
    rewards = rewards_of([reward_len, same_length_as_answer], [0.5, 2.0])
    hand = [0.5 * -abs(20 - len(t)) + 2.0 * (len(t) == 4) for t in TEXTS]
    assert rewards.tolist() == pytest.approx(hand)


def test_group_level_reward_sees_the_whole_batch():
    def rank_in_group(prompts, completions, **kwargs):
        # a group-level reward: the rank of each completion's length within its group, 0..G-1
        out = []
        for i, c in enumerate(completions):
            group = completions[i // 4 * 4:i // 4 * 4 + 4]
            out.append(float(sum(len(o) < len(c) for o in group)))
        return out

    def unique_in_group(completions, **kwargs):       # diversity: 1 if no other in its group is the same
        return [float(completions[i // 4 * 4:i // 4 * 4 + 4].count(c) == 1) for i, c in enumerate(completions)]
    got = rewards_of([rank_in_group, unique_in_group], [1.0, 10.0])
    # by hand: lengths 2, 20, 24, 35 | 0, 4, 4, 3 -> ranks 0 1 2 3 | 0 2 2 1; "dcba" twice in group 2
    assert got.tolist() == [10.0, 11.0, 12.0, 13.0, 10.0, 2.0, 2.0, 11.0]


def test_none_is_skipped_and_a_sample_no_reward_applies_to_is_an_error():
    def only_short(completions, **kwargs):                     # TRL: None = "does not apply"
        return [1.0 if len(c) < 5 else None for c in completions]

    def only_long(completions, **kwargs):
        return [3.0 if len(c) >= 5 else None for c in completions]
    got = rewards_of([only_short, only_long], [1.0, 2.0])
    assert got.tolist() == [1.0 if len(t) < 5 else 6.0 for t in TEXTS]
    with pytest.raises(tg.TrainerError, match=r"every reward function returned None.*sample 1 "):
        rewards_of([only_short], [1.0])


@pytest.mark.parametrize("returned, words", [("[1.0] * 7", "not a list of 8 values"), ("1.0", "not a list"),
                                             ("[math.nan] * 8", "nan for sample 0, not a finite number"),
                                             ("[1.0] * 7 + [-math.inf]", "-inf for sample 7, not a finite number")])
def test_a_wrong_batched_return_is_an_error_naming_the_function(returned, words):
    def bad_reward(completions, **kwargs):
        return eval(returned)
    with pytest.raises(tg.TrainerError, match="bad_reward") as e:
        rewards_of([bad_reward], [1.0])
    assert words in str(e.value)


@pytest.mark.parametrize("returned, error, words", [
    ("['a'] * 8", ValueError, "could not convert string to float: 'a'"),
    ("[[1.0]] * 8", TypeError, "float() argument must be a string or a real number, not 'list'"),
])
def test_a_value_float_cannot_read_is_pythons_own_error(returned, error, words):
    """A reward's value is what float() makes of it: a value it cannot read stops the step with float's error."""
    def bad_reward(completions, **kwargs):
        return eval(returned)
    with pytest.raises(error) as e:
        rewards_of([bad_reward], [1.0])
    assert str(e.value) == words


def test_a_value_float_reads_is_that_number():
    """float()'s reading, by hand: text and numpy's and torch's scalars are numbers too."""
    import numpy as np

    def mixed(completions, **kwargs):
        return ["0.5", 2, np.float32(0.25), torch.tensor(1.5), True, " -3 ", "1e3", None]

    def one(completions, **kwargs):
        return [1.0] * 8
    assert rewards_of([mixed, one], [1.0, 0.0]).tolist() == [0.5, 2.0, 0.25, 1.5, 1.0, -3.0, 1000.0, 0.0]


TRL_FILE = '''
import json, os, re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]

def seen(prompts, completions, completion_ids, level, **kwargs):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                level=level, others=sorted(kwargs))) + "\\n")
    return [float(len(c[0]["content"])) for c in completions]
'''


def test_trl_rewards_on_a_conversational_dataset_get_what_trl_gives(tmp_path, model_dir, monkeypatch):  # noqa
    from transformers import AutoTokenizer
    (tmp_path / "trl_rewards.py").write_text(TRL_FILE)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    rows = [{"prompt": [{"role": "user", "content": f"Count to {n}."}], "level": n, "tag": f"t{n}"}
            for n in range(8)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    f = tmp_path / "trl_rewards.py"
    tg.main(REAL + ["--model_name_or_path", model_dir, "--dataset", data, "--max_steps", "2",
                    "--reward_funcs", f"{f}:format_reward_func,{f}:seen", "--reward_weights", "5,1",
                    "--save_dir", str(tmp_path / "run")])
    tok = AutoTokenizer.from_pretrained(model_dir)
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    logged = [json.loads(line)["reward"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(calls) == 2 and len(logged) == 2                              # once per step, all rows
    for call, reward in zip(calls, logged):
        assert len(call["prompts"]) == 2 * 2 and call["others"] == ["tag"]  # every other column, as lists
        for prompt, completion, ids, level in zip(call["prompts"], call["completions"], call["completion_ids"],
                                                  call["level"]):
            assert prompt == rows[level]["prompt"]                            # the dataset's own messages
            assert len(completion) == 1 and completion[0]["role"] == "assistant"
            assert completion[0]["content"] == tok.decode(ids, skip_special_tokens=True)
        texts = [c[0]["content"] for c in call["completions"]]
        hand = [5.0 * bool(re.match(r"^<think>.*?</think><answer>.*?</answer>$", t)) + len(t) for t in texts]
        assert reward == pytest.approx(sum(hand) / len(hand))


def test_held_out_score_calls_a_batched_reward_on_the_eval_batch(tmp_path):
    (tmp_path / "r.py").write_text("def reward_len(completions, **kwargs):\n"
                                   "    return [-abs(20 - len(completion)) for completion in completions]\n")
    args = tg.parse_args(["--reward_funcs", f"{tmp_path / 'r.py'}:reward_len", "--eval_size", "16"])
    *_, fns, weights, key = tg.load_task(args, 1)
    rows = [{"prompt": "edcba=", "answer": "abcde"}, {"prompt": "ab=", "answer": "ba"}]
    prompts = [r["prompt"] for r in rows]
    assert key == "eval_reward"
    scores = rewards_of_functions(fns, weights, prompts, ["abcde", "ba"], [[3, 4, 5, 6, 7, 1], [4, 3, 1]], rows)
    assert scores.tolist() == [-15.0, -18.0]


def test_a_reward_that_needs_what_this_trainer_does_not_pass_is_pythons_type_error_with_a_note(tmp_path):
    """TRL 1.x also passes trainer_state; this trainer passes the prompts, completions, ids and columns only. The
    call's TypeError is Python's own, and a note names the function and the samples it was called on."""
    (tmp_path / "r.py").write_text("def curriculum(completions, trainer_state, **kwargs):\n"
                                   "    return [float(trainer_state.global_step) for _ in completions]\n")
    fns = tg.load_reward_funcs(f"{tmp_path / 'r.py'}:curriculum")
    with pytest.raises(TypeError) as e:
        rewards_of(fns, [1.0])
    assert str(e.value) == "curriculum() missing 1 required positional argument: 'trainer_state'"
    assert e.value.__notes__ == ["in reward function curriculum, called by train_grpo.py on 8 samples"]


# ---- 2. GSPO: one ratio per sequence ----
def test_sequence_ratio_loss_gradient_and_clip_ratio_by_hand():
    """mu = 2: the second update's logps differ from old, so the sequence ratios leave [1 - eps, 1 + eps]."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.3, -0.7, -1.1, -0.2], [-2.0, -1.0, -0.4, -0.6]])
    shift = torch.tensor([[0.3, 0.1, 0.2, 5.0], [-0.2, -0.4, 0.0, 0.1], [0.05, -0.05, 0.02, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])          # token 4 of row 0 is padding
    A = torch.tensor([1.0, -1.0, 2.0])
    logps = (old + shift).requires_grad_(True)
    loss, stats = tg.policy_objective(logps, old, A, mask, loss_type="grpo", epsilon=0.1, epsilon_high=0.1,
                               divisor=3, importance_sampling_level="sequence")
    loss.backward()
    # by hand, per sequence: s = exp(mean of the masked shifts); L_i = -min(s A, clip(s, 0.9, 1.1) A) on each of
    # its tokens, so grpo's mean over the tokens of o_i is L_i itself and the loss is mean_i L_i
    hand_loss, hand_grad, clipped_tokens = 0.0, torch.zeros(3, 4), 0
    for i in range(3):
        n = int(mask[i].sum())
        s = math.exp(sum(shift[i, t].item() for t in range(n)) / n)  # row 0: 1.22, row 1: 0.80, row 2: 1.0
        a = A[i].item()
        unclipped, clip = s * a, min(max(s, 0.9), 1.1) * a
        hand_loss += -min(unclipped, clip) / 3
        if unclipped <= clip:                     # d(-s A)/dlogp_t = -A s / n on each masked token of o_i
            hand_grad[i, :n] = -a * s / n / 3
        else:
            clipped_tokens += n                   # the clip binds: no gradient, every token counted
    assert loss.item() == pytest.approx(hand_loss, rel=1e-6)
    torch.testing.assert_close(logps.grad, hand_grad)
    assert stats["clipped_tokens"].item() == clipped_tokens and clipped_tokens == 3 + 4   # of 9
    # the token ratio is another objective on the same batch (row 0's tokens clip one by one)
    token_loss, _ = tg.policy_objective(logps.detach(), old, A, mask, loss_type="grpo", epsilon=0.1, epsilon_high=0.1,
                                 divisor=3)
    assert token_loss.item() != pytest.approx(loss.item())


def test_gspo_refuses_cispo_in_one_line():
    problems = list(tg.check_args(tg.Args(loss_type="cispo", importance_sampling_level="sequence")))
    assert len(problems) == 1 and "--importance_sampling_level sequence" in problems[0]
    assert not list(tg.check_args(tg.Args(loss_type="grpo", importance_sampling_level="sequence")))
