"""Work done once: each prompt tokenized once a step, each completion's ids built once; final/ is the last
checkpoint's model, not another save."""
import os

import pytest
import torch

from helpers import FAST, evaluate_with, make_run, tg, tiny
from test_real_path import one_thread  # noqa: F401  (an autouse fixture)

ROWS = [{"prompt": "ab=", "answer": "ba"}, {"prompt": "abcdef=", "answer": "fedcba"}]  # the second is cut


def one_step(monkeypatch, texts=None, reward=tg.reverse_reward):
    """One real grpo_step of the tiny model on ROWS, G = 4, prompts cut at 4 tokens: its record and the prompt
    ids and mask its rollout got. texts: a list that records every text the tokenizer is called on."""
    model, tok = tiny()
    if texts is not None:
        class Spy(type(tok)):
            def __call__(self, text, *a, **k):
                texts.extend([text] if isinstance(text, str) else text)
                return super().__call__(text, *a, **k)
        tok.__class__ = Spy
    args = tg.parse_args(["--batch_size", "2", "--num_generations", "4", "--max_gen_len", "4",
                          "--max_prompt_len", "4"])
    optimizer, scheduler = tg.build_optimizer(model, args)
    run = make_run(model, tok, optimizer, reward_fns=[reward], weights=[1.0], scheduler=scheduler)
    seen, real = [], tg.rollout
    monkeypatch.setattr(tg, "rollout", lambda *a, **k: seen.append(a[1:3]) or real(*a, **k))
    return tg.grpo_step(args, run, ROWS, tg.TrainState())[0], seen[0]


def test_each_prompt_is_tokenized_once_a_step_and_repeated_in_contiguous_groups(monkeypatch):
    texts = []
    record, (prompt_ids, prompt_mask) = one_step(monkeypatch, texts)
    assert [texts.count(r["prompt"]) for r in ROWS] == [1, 1]                  # B calls' worth, not B x G
    # by hand (<pad> 0, a 3, b 4, c 5, d 6, e 7, f 8, '=' 11): "ab=" left-padded, "abcdef=" cut to its end
    assert prompt_ids.tolist() == [[0, 3, 4, 11]] * 4 + [[6, 7, 8, 11]] * 4
    assert prompt_mask.tolist() == [[0, 1, 1, 1]] * 4 + [[1, 1, 1, 1]] * 4
    assert record["prompts_cut"] == 1                                    # prompts, not completions


def test_the_completion_ids_are_built_once_a_step_and_an_eval_batch_and_the_texts_decoded_from_them(monkeypatch):
    calls, real = [], tg.completion_token_ids
    monkeypatch.setattr(tg, "completion_token_ids", lambda *a: calls.append(a) or real(*a))
    given = []

    def batched(completions, completion_ids, **row):  # TRL's form: sees both
        given.append((completions, completion_ids))
        return [0.0] * len(completions)
    one_step(monkeypatch, reward=batched)
    assert len(calls) == 1
    (texts, ids), = given
    model, tok = tiny()
    (comp, mask), = calls
    assert ids == [c[m.bool()].tolist() for c, m in zip(comp, mask)]         # up to and including the EOS
    assert texts == [tok.decode(c[m.bool()], skip_special_tokens=True) for c, m in zip(comp, mask)]
    calls.clear()
    score = lambda completions, completion_ids, **k: [float(t == tok.decode(i, skip_special_tokens=True))
                                                      for t, i in zip(completions, completion_ids)]
    assert evaluate_with(model, tok, ROWS, score, tg.Args(max_gen_len=4)) == 1.0
    assert len(calls) == 1                                                     # one eval batch: once


def test_final_is_the_last_checkpoints_weights_without_the_trainer_state(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    trained = tg.main(FAST + ["--max_steps", "2", "--save_dir", str(tmp_path)])["model"].state_dict()
    final, ckpt = tmp_path / "final", tmp_path / "checkpoint-2"
    assert list(ckpt.glob("*.pt")) and not list(final.glob("*.pt"))      # no trainer state, no RNG state
    assert AutoTokenizer.from_pretrained(final)("ab=").input_ids == [3, 4, 11]
    weights = AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert weights.keys() == trained.keys() and all(torch.equal(weights[k], trained[k]) for k in trained)
    saved, last = load_file(final / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert saved.keys() == last.keys() and all(torch.equal(saved[k], last[k]) for k in last)
    # save_pretrained rewrites config.json in place: final/ is a copy, so an edit of final/ leaves the checkpoint
    assert not os.path.samefile(final / "config.json", ckpt / "config.json")
    # resumed from that finished checkpoint into a folder where another run (seed 1) left its checkpoint-2, a run
    # stops and leaves that run as it was; into a folder of its own it trains nothing, and final/ is its files
    other = tg.main(FAST + ["--max_steps", "2", "--save_dir", str(tmp_path / "b"), "--seed", "1"])["model"]
    assert not torch.equal(other.state_dict()["lm_head.weight"], trained["lm_head.weight"])
    with pytest.raises(tg.TrainerError, match="holds an earlier run: continue it with --resume auto, or give another"):
        tg.main(FAST + ["--max_steps", "2", "--save_dir", str(tmp_path / "b"), "--resume", str(ckpt)])
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "final").state_dict()
    assert all(torch.equal(weights[k], other.state_dict()[k]) for k in trained)
    tg.main(FAST + ["--max_steps", "2", "--save_dir", str(tmp_path / "c"), "--resume", str(ckpt)])
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "c" / "final").state_dict()
    assert all(torch.equal(weights[k], trained[k]) for k in trained)
