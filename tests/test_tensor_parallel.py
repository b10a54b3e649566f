"""Tensor and expert parallel over a JAX mesh of 8 forced CPU devices: greedy output equals TP=1,
and sizes that cannot split the model are refused with a clear message."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def parallel_results(smollm2_path):
    proc = subprocess.run([sys.executable, os.path.join(HERE, "parallel_check.py"), smollm2_path],
                          capture_output=True, text=True, timeout=900, cwd=os.path.dirname(HERE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_eight_forced_devices(parallel_results):
    assert parallel_results["devices"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("tp", ["tp2", "tp4"])
def test_tensor_parallel_greedy_equals_one_device(parallel_results, tp):
    llama = parallel_results["llama"]
    assert isinstance(llama["tp1"], list) and len(llama["tp1"]) == 3
    assert llama[tp] == llama["tp1"]


@pytest.mark.slow
def test_expert_parallel_greedy_equals_one_device(parallel_results):
    mixtral = parallel_results["mixtral"]
    assert isinstance(mixtral["tp1"], list)
    assert mixtral["ep2"] == mixtral["tp1"]
    assert mixtral["tp2_without_ep"].startswith("ValueError") and "enable_expert_parallel" in mixtral["tp2_without_ep"]


@pytest.mark.slow
def test_smollm2_splits_three_ways_and_refuses_two(parallel_results):
    s = parallel_results["smollm2"]
    assert isinstance(s["tp1"], list) and s["tp3"] == s["tp1"]
    assert s["tp2"].startswith("ValueError") and "attention heads 9" in s["tp2"] and "KV heads 3" in s["tp2"]
    assert "sizes that divide them all: 1, 3" in s["tp2"]
    assert s["tp16"].startswith("ValueError") and "only 8 CPU device(s)" in s["tp16"]
