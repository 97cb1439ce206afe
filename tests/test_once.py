"""Work done once: each prompt tokenized once a step, each completion's ids built once, the final model
serialized once (final/ is the last checkpoint's files)."""
import torch

from helpers import make_run, tg, tiny

ROWS = [{"prompt": "ab=", "answer": "ba"}, {"prompt": "abcdef=", "answer": "fedcba"}]  # the second is cut


def one_step(monkeypatch, texts=None):
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
    run = make_run(model, tok, optimizer, reward_fns=[tg.reverse_reward], weights=[1.0], scheduler=scheduler)
    seen, real = [], tg.rollout
    monkeypatch.setattr(tg, "rollout", lambda *a, **k: seen.append(a[1:3]) or real(*a, **k))
    return tg.grpo_step(args, run, ROWS, tg.TrainState()), seen[0]


def test_each_prompt_is_tokenized_once_a_step_and_repeated_in_contiguous_groups(monkeypatch):
    texts = []
    record, (prompt_ids, prompt_mask) = one_step(monkeypatch, texts)
    assert [texts.count(r["prompt"]) for r in ROWS] == [1, 1]                  # B calls' worth, not B x G
    # by hand (<pad> 0, a 3, b 4, c 5, d 6, e 7, f 8, '=' 11): "ab=" left-padded, "abcdef=" cut to its end
    assert prompt_ids.tolist() == [[0, 3, 4, 11]] * 4 + [[6, 7, 8, 11]] * 4
    assert prompt_mask.tolist() == [[0, 1, 1, 1]] * 4 + [[1, 1, 1, 1]] * 4
    assert record["truncated_prompts"] == 1                                    # prompts, not completions
