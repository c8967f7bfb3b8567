"""Placement across nodes on a real 2-node Ray cluster (two raylets on this machine).

Marked ``multinode``: it starts its own Ray cluster in a subprocess (not the session's), so it
runs only with ``bash scripts/test.sh --multinode``.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.multinode
def test_one_rank_per_node_and_packing():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "multinode_check.py")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["nodes"] == 2
    spread = result["spread_nodes"]
    assert len(set(spread)) == 2 and spread[0] == result["driver_node"]  # rank 0 beside the driver
    assert result["spread_local"] == [[0, 1], [0, 1]]
    assert result["spread_all_reduce"] == [[3.0], [3.0]]
    assert len(set(result["packed_nodes"])) == 1
