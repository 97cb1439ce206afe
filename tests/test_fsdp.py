"""FSDP2 (`--fsdp 1`) for real: 2 gloo processes on CPU, ranks fed different prompts. The step is the same step
as under DDP; parameters, gradients and AdamW state are sharded; checkpoints are plain HF directories."""
import json

import pytest
import torch

from helpers import FAST, run_cli, run_clis, spawn, tiny
import dist_workers
from test_precision import adam_step_bound
from test_real_path import load_final

STEPS = ["--max_steps", "3", "--micro_batch_size", "8", "--beta", "0.04", "--use_adaptive_entropy", "1",
         "--entropy_target", "5.0", "--entropy_coef_delta", "0.001"]  # 2 micro-steps, a reference, the bonus on


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    run = lambda mode, moe: (f"{mode}{moe}", FAST + STEPS + ["--use_moe", str(moe), "--fsdp", str(int(mode == "fsdp"))])
    for mode, moe in (("ddp", 0), ("fsdp", 0), ("ddp", 1), ("fsdp", 1)):  # fresh processes for each run
        spawn(dist_workers.train_and_capture, [run(mode, moe)], str(out))
    load = lambda tag, r: torch.load(out / f"{tag}_rank{r}.pt", weights_only=True)
    metrics = lambda tag: [json.loads(l) for l in open(out / tag / "metrics.jsonl")]
    return out, load, metrics


@pytest.mark.parametrize("moe", [0, 1])
def test_fsdp_takes_the_same_steps_as_ddp(runs, moe):
    out, load, metrics = runs
    ddp, fsdp = load(f"ddp{moe}", 0), load(f"fsdp{moe}", 0)
    assert fsdp["fsdp"] and not ddp["fsdp"]
    # step 1 starts from the same weights and data: the gradient the optimizer receives is the same up to
    # the order of fp32 sums (reduce-scatter vs all-reduce, a sharded vs a whole grad norm): 1e-5 relative
    # is ~100 float32 epsilons
    for g_fsdp, g_ddp in zip(fsdp["grads"], ddp["grads"]):
        torch.testing.assert_close(g_fsdp, g_ddp, rtol=1e-5, atol=1e-5 * g_ddp.abs().max().item() + 1e-12)
    m_ddp, m_fsdp = metrics(f"ddp{moe}"), metrics(f"fsdp{moe}")
    for k in ("loss", "policy_loss", "entropy", "kl", "grad_norm"):
        assert m_fsdp[0][k] == pytest.approx(m_ddp[0][k], rel=1e-5, abs=1e-9), k
    assert [r["entropy_coef"] for r in m_fsdp] == [r["entropy_coef"] for r in m_ddp] == pytest.approx([1e-3, 2e-3, 3e-3])
    # after 3 AdamW steps no weight can be further apart than twice the largest step Adam can take
    tol = 2 * 2e-4 * sum(adam_step_bound(t) for t in (1, 2, 3))
    for k, v in ddp["params"].items():
        assert (fsdp["params"][k] - v).abs().max().item() <= tol, k


@pytest.mark.parametrize("moe", [0, 1])
def test_fsdp_shards_and_the_loss_forward_goes_through_the_sharded_module(runs, moe):
    out, load, _ = runs
    for r in (0, 1):
        fsdp, ddp = load(f"fsdp{moe}", r), load(f"ddp{moe}", r)
        assert fsdp["total"] == ddp["total"] == ddp["local"]        # DDP: every rank holds everything
        assert fsdp["local"] <= 0.55 * fsdp["total"]                # FSDP: about half each (dim-0 shards)
        # 3 steps x 2 micro-steps graph forwards through the root's __call__, where FSDP gathers parameters
        # (a forward through model.forward would skip its hooks, as one through model.module skips DDP's)
        assert fsdp["root_calls"] == ddp["root_calls"] == 6


def test_fsdp_final_directory_loads_in_a_plain_process_with_the_trained_weights(runs):
    from transformers import AutoModelForCausalLM
    out, load, _ = runs
    trained = load("fsdp0", 0)["params"]
    model, tok = tiny()
    model.load_state_dict(trained)
    saved = AutoModelForCausalLM.from_pretrained(out / "fsdp0" / "final")
    ids = torch.tensor([tok("abcde=").input_ids])
    assert torch.equal(saved(ids).logits, model(ids).logits)


def test_fsdp_resume_continues_exactly(tmp_path):
    common = [*FAST, "--max_steps", "4", "--fsdp", "1", "--beta", "0.04", "--lr_scheduler", "cosine",
              "--warmup_steps", "2", "--sft_warmup_steps", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    straight, first = run_clis([*common, "--save_dir", a], [*common, "--stop_after", "2", "--save_dir", b], nproc=2)
    assert straight.returncode == 0 and first.returncode == 0, straight.stderr[-3000:] + first.stderr[-3000:]
    assert sorted(p.name for p in (b / "checkpoint-2").glob("optimizer_*.pt")) == ["optimizer_0.pt", "optimizer_1.pt"]
    second = run_cli(*common, "--resume", "auto", "--save_dir", b, nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    wa, wb = load_final(a), load_final(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_fsdp_old_log_probs_keep_only_the_last_hidden_state(tmp_path):
    """mu > 1 under FSDP: the no-grad pass goes through the root's forward (it gathers the embeddings and
    lm_head) and still keeps no layer's hidden states but the last, with the log-probs of a full-logits forward."""
    spawn(dist_workers.fsdp_old_logps_keep_one_hidden_state, str(tmp_path))
    for r in (0, 1):
        got = torch.load(tmp_path / f"old_{r}.pt", weights_only=True)
        assert got["asked"] == got["returned"] == [False]       # one forward, no per-layer hidden states
        assert got["alive"] == [1]     # when the final norm ran, only its input: the last layer's output
        torch.testing.assert_close(got["old"].double(), got["want"], rtol=0, atol=1e-5)
    load = lambda r: torch.load(tmp_path / f"old_{r}.pt", weights_only=True)["want"]
    assert not torch.equal(load(0), load(1))                    # the ranks scored different rollouts
