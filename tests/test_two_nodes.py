"""Two nodes, here on one machine: two torchrun launchers of one process each meet at node 0's address and
train exactly as one node with two processes: the same metrics, the same final weights."""
import json
import sys

import pytest
import torch

from helpers import FAST, TRAIN, cli_command, free_port, run_commands
from test_real_path import load_final

FLAGS = FAST + ["--max_steps", "2", "--batch_size", "2"]
TIMINGS = {"step_time", "generate_time", "tokens_per_s", "peak_mem_gib"}


def node_commands(args):
    """The README's two-node command, once per node: the same flags, the node's rank, node 0's address."""
    port = str(free_port())
    return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port, TRAIN,
             *map(str, args)] for node in (0, 1)]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_nodes")
    # the three launchers at once: one node of 2 processes, and two nodes of 1 sharing a save_dir
    commands = [cli_command(FLAGS + ["--save_dir", out / "one_node"], 2),
                *node_commands(FLAGS + ["--save_dir", out / "two_nodes"])]
    for res in run_commands(*commands, timeout=300):
        assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_two_nodes_train_as_one_node_with_two_processes(out):
    metrics = lambda d: [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
                         for line in open(out / d / "metrics.jsonl")]
    one, two = metrics("one_node"), metrics("two_nodes")
    # the one-node run is also the torchrun CLI's check: it ran (exit 0 above), rank 0 alone logs, final/ is saved
    assert [r["step"] for r in one] == [1, 2] and one == two
    w1, w2 = load_final(out / "one_node"), load_final(out / "two_nodes")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
