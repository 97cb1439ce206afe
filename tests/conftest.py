"""Disk: one SmolLM2 checkpoint is ~2 GB (weights + AdamW state), and a suite that kept every test's folder
until the end filled a CI disk. Each test's tmp_path is removed as soon as the test ends, pass or fail."""
import re
import shutil

import pytest


@pytest.fixture
def tmp_path(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(re.sub(r"\W", "_", request.node.name)[:30])  # as pytest names it
    yield path
    shutil.rmtree(path, ignore_errors=True)
