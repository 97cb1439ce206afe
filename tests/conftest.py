"""Disk: one SmolLM2 checkpoint is ~2 GB (weights + AdamW state), and a suite that kept every test's folder
until the end filled a CI disk. Each test's tmp_path is removed as soon as the test ends, pass or fail.
Before that, every .jsonl log the test wrote there is read line by line by a JSON reader that refuses NaN and
infinity, as jq and JavaScript do: a log line is strict JSON."""
import json
import re
import shutil

import pytest


@pytest.fixture
def tmp_path(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(re.sub(r"\W", "_", request.node.name)[:30])  # as pytest names it
    yield path
    try:
        for log in path.rglob("*.jsonl"):
            for line in open(log):
                json.loads(line, parse_constant=refuse)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def refuse(constant):
    raise ValueError(f"{constant} in a log line is not JSON")
