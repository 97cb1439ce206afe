"""Memory of one loss forward + backward through lm_head, three ways (a script: pytest does not collect it).

    python tests/bench_memory.py            # CPU: hidden 896 -> Qwen vocab 151,936, batch 4, 1024 completion tokens
    python tests/bench_memory.py --gpu      # CUDA: batch 4, 2048 tokens, torch.cuda.max_memory_allocated
    python tests/bench_memory.py --small    # CPU, 128 tokens: a dry run of the script itself

(a) entropy in the graph (the OOM bug), (b) entropy detached but full [rows, T, V] logits (the known fix),
(c) this trainer: chunked lm_head with recomputation in backward, entropy under no_grad.
Each variant runs in its own process so that peak process memory (ru_maxrss) is its own.
"""
import os
import resource
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_grpo as tg  # noqa: E402

H, V = 896, 151_936


class Head(torch.nn.Module):
    """The lm_head alone, with what tg.lm_logits reads from a model: its config and output embeddings."""

    def __init__(self, lm_head):
        from transformers import PretrainedConfig
        super().__init__()
        self.lm_head = lm_head
        self.config = PretrainedConfig()

    def get_output_embeddings(self):
        return self.lm_head


def chunked(lm_head, hidden, targets, chunk_size):
    """completion_logps' chunk loop on given hidden states: each chunk's logits recomputed in backward."""
    from torch.utils.checkpoint import checkpoint
    head = Head(lm_head)
    parts = [checkpoint(tg._chunk_logps_entropy, head, h, y, 1.0, False, use_reentrant=False)
             for h, y in zip(hidden.reshape(-1, hidden.shape[-1]).split(chunk_size), targets.reshape(-1).split(chunk_size))]
    return (torch.cat([p[i] for p in parts]).view(targets.shape) for i in (0, 1))


def one_variant(variant, rows, T, device):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(H, V, bias=False, device=device)
    hidden = torch.randn(rows, T, H, device=device, requires_grad=True)
    targets = torch.randint(0, V, (rows, T), device=device)
    adv = torch.randn(rows, device=device)
    mask = torch.ones(rows, T, device=device)
    saved = [0, 0]  # current, peak bytes saved for backward

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        saved[1] = max(saved[1], saved[0])
        return t
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if variant == "c":
            logps, entropy = chunked(lm_head, hidden, targets, 256)  # 4 rows x 64 positions
        else:
            logits = lm_head(hidden).float()                                     # [rows, T, V] in the graph
            logps = tg.selective_log_softmax(logits, targets)
            if variant == "a":
                entropy = tg.entropy_from_logits(logits)                          # graph kept only to be logged
            else:
                with torch.no_grad():
                    entropy = tg.entropy_from_logits(logits.detach())
        loss, _ = tg.policy_objective(logps, logps.detach(), adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
                               divisor=rows)
        _ = (entropy * mask).sum().item()                                        # logged
    loss.backward()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss      # KiB on Linux
    gpu = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    print(saved[1], peak_rss * 1024, gpu)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":
        v, rows, T, device = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        torch.set_num_threads(max(1, torch.get_num_threads()))
        return one_variant(v, rows, T, device)
    gpu = "--gpu" in sys.argv and torch.cuda.is_available()
    rows, T, device = (4, 2048, "cuda") if gpu else (4, 128 if "--small" in sys.argv else 1024, "cpu")
    print(f"lm_head {H} -> {V}, batch {rows}, completion length {T}, device {device}")
    res = {}
    for v in "abc":
        out = subprocess.run([sys.executable, __file__, "--variant", v, str(rows), str(T), device],
                             capture_output=True, text=True, check=True)
        res[v] = [int(x) for x in out.stdout.split()]
    names = {"a": "(a) entropy in graph", "b": "(b) entropy detached, full logits", "c": "(c) this trainer (chunked)"}
    print(f"{'variant':36s} {'saved for backward':>20s} {'peak process mem':>18s} {'cuda max alloc':>16s}")
    for v in "abc":
        s, r, g = res[v]
        print(f"{names[v]:36s} {s / 2**20:17.1f} MiB {r / 2**20:15.1f} MiB {g / 2**20:13.1f} MiB")
    for what, i in (("saved-for-backward", 0), ("peak process memory" if not gpu else "cuda max allocated", 1 if not gpu else 2)):
        print(f"{what}: c/b = {res['c'][i] / res['b'][i]:.3f}   c/a = {res['c'][i] / res['a'][i]:.3f}")


if __name__ == "__main__":
    main()
