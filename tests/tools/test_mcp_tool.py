"""MCPTool against real MCP servers (tests/tools/fixtures/mcp_calc_server.py, the SDK's own MCPServer)
over stdio and streamable HTTP: function schemas, calls, errors, a killed / crashed / hung server and
the reconnect after it, bad config, and secrets kept out of errors, reprs and logs."""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from verl_arpo.workers.rollout.tools import mcp_tool
from verl_arpo.workers.rollout.tools.base_tool import FunctionCall, ToolError, ToolInfraError
from verl_arpo.workers.rollout.tools.mcp_tool import MCPTool
from verl_arpo.workers.rollout.tools.registry import ToolExecutor
from verl_arpo.workers.rollout.tools.schema import PROPERTY_KEYS

SERVER = str(Path(__file__).parent / "fixtures" / "mcp_calc_server.py")
COMMAND = [sys.executable, SERVER]
FUNCTIONS = {"add", "echo", "fail", "sleep", "clamp", "crash"}


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_background(fn, *args):
    """Run fn(*args) on a thread; returns (thread, box) where box gets 'result' or 'error' and 'seconds'."""
    box: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            box["result"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc
        box["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


@pytest.fixture(scope="module")
def calc():
    tool = MCPTool(command=COMMAND, env={"CALC_TOKEN": "ENVSECRET789"}, name="calc", call_timeout=10)
    yield tool
    tool.close()


@pytest.fixture(scope="module")
def http_server():
    port = _free_port()
    proc = subprocess.Popen([*COMMAND, "--http", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 30
    while True:   # up when its endpoint answers HTTP (any status: a bare GET is not an MCP request)
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not start"
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()


# ------------------------------------------------------------------------------------ stdio
def test_stdio_functions_calls_and_errors(calc):
    fns = {f["function"]["name"]: f for f in calc.functions()}
    assert set(fns) == FUNCTIONS and calc.trigger_tag == calc.name == "calc"
    add = fns["add"]["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["type"] == "object"
    assert {k: v["type"] for k, v in add["parameters"]["properties"].items()} == {"a": "integer", "b": "integer"}
    assert sorted(add["parameters"]["required"]) == ["a", "b"]
    assert fns["echo"]["function"]["parameters"]["properties"]["text"]["type"] == "string"
    assert fns["sleep"]["function"]["parameters"]["properties"]["seconds"]["type"] == "number"
    assert fns["crash"]["function"]["parameters"]["properties"] == {}
    # clamp's schema has exclusiveMinimum/exclusiveMaximum/multipleOf: stripped, the rest kept
    x = fns["clamp"]["function"]["parameters"]["properties"]["x"]
    assert x["type"] == "number" and set(x) <= PROPERTY_KEYS and "multipleOf" not in x

    assert calc.call("add", {"a": 2, "b": 40}) == str(2 + 40)
    assert calc.call("add", {"a": -7, "b": 1000}) == str(-7 + 1000)
    assert calc.call("echo", {"text": "héllo <b>"}) == "héllo <b>"
    assert calc.call("clamp", {"x": 2.5}) == "2.5"
    with pytest.raises(ToolError) as err:
        calc.call("fail", {"text": "boom-123"})
    assert "fail was asked to fail: boom-123" in str(err.value)
    assert not isinstance(err.value, ToolInfraError) and err.value.retryable is False
    with pytest.raises(ToolError, match="no function 'nope'"):
        calc.call("nope", {})
    # the tag format: a JSON object naming the function
    assert calc.run('{"name": "add", "arguments": {"a": 5, "b": 6}}') == "11"
    with pytest.raises(ToolError, match="write a JSON object") as err:
        calc.run("add(5, 6)")
    assert err.value.retryable is False
    assert calc.server_pid is not None and _alive(calc.server_pid)


def test_stdio_concurrent_calls_share_one_session(calc):
    pid, before = calc.server_pid, calc.metrics()
    pairs = [(i, 10 * i + 3) for i in range(8)]
    threads = [_in_background(calc.call, "add", {"a": a, "b": b}) for a, b in pairs]
    for th, _ in threads:
        th.join(30)
    assert [box.get("result") for _, box in threads] == [str(a + b) for a, b in pairs]
    after = calc.metrics()
    assert after["calls"] - before["calls"] == len(pairs) and after["reconnects"] == before["reconnects"]
    assert calc.server_pid == pid


def test_executor_from_config_with_the_docstring_yaml():
    block = re.search(r"\n(    tools:\n(?: {5,}.*\n)+)", mcp_tool.__doc__).group(1)
    cfg = yaml.safe_load(textwrap.dedent(block))
    spec = cfg["tools"]["tool_instances"]["calc"]
    assert spec["params"]["command"] == ["python", "-m", "my_mcp_server"]
    spec["params"]["command"] = COMMAND   # the documented example, on our test server
    with ToolExecutor.from_config(cfg) as ex:
        table = ex.function_table()
        assert set(table) == FUNCTIONS and {tag for tag, _ in table.values()} == {"calc"}
        r = ex.execute("calc", FunctionCall("add", {"a": 20, "b": 22}))
        assert (r.text, r.ok, r.infra) == ("42", True, False)
        r = ex.execute("calc", FunctionCall("fail", {"text": "x"}))
        assert not r.ok and not r.infra and r.attempts == 1 and "fail was asked to fail: x" in r.text
        tool = ex.tools["calc"]
        pid = tool.server_pid
        assert ex.metrics()["tools/calc/calls"] == 2
    assert not _alive(pid)   # closing the executor closed the tool and stopped its server


# ------------------------------------------------------------------------------------- HTTP
def test_http_functions_and_call(http_server):
    tool = MCPTool(url=http_server, headers={"Authorization": "Bearer SECRET123"}, name="calc_http")
    try:
        assert {f["function"]["name"] for f in tool.functions()} == FUNCTIONS
        add = next(f for f in tool.functions() if f["function"]["name"] == "add")["function"]["parameters"]
        assert {k: v["type"] for k, v in add["properties"].items()} == {"a": "integer", "b": "integer"}
        assert tool.call("add", {"a": 2, "b": 40}) == "42"
        assert tool.call("echo", {"text": "over http"}) == "over http"
        assert tool.server_pid is None
        assert "SECRET123" not in repr(tool) and "Authorization" in repr(tool)
    finally:
        tool.close()


# -------------------------------------------------------------------- a server dies or hangs
def test_killed_and_crashing_server_then_reconnect():
    tool = MCPTool(command=COMMAND, name="calc", call_timeout=10)
    try:
        pid = tool.server_pid
        th, box = _in_background(tool.call, "sleep", {"seconds": 5})
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        th.join(20)
        assert isinstance(box.get("error"), ToolInfraError), box
        assert box["seconds"] < 3, box   # the broken pipe is noticed, not the 5 s sleep nor the 10 s timeout
        assert str(box["error"]).startswith("MCP server calc: ")
        assert tool.call("add", {"a": 2, "b": 40}) == "42"
        assert tool.metrics()["reconnects"] == 1 and tool.server_pid not in (None, pid)

        t0 = time.monotonic()
        with pytest.raises(ToolInfraError, match="MCP server calc"):
            tool.call("crash", {})   # the server exits during the call
        assert time.monotonic() - t0 < 3
        assert tool.call("add", {"a": 1, "b": 1}) == "2"
        m = tool.metrics()
        assert (m["reconnects"], m["infra_errors"], m["calls"]) == (2, 2, 4)
    finally:
        tool.close()


def test_hung_server_times_out_then_reconnects():
    tool = MCPTool(command=COMMAND, name="calc", call_timeout=1)
    try:
        pid = tool.server_pid
        t0 = time.monotonic()
        with pytest.raises(ToolInfraError, match=r"no answer within 1 s") as err:
            tool.call("sleep", {"seconds": 30})
        assert time.monotonic() - t0 < 4
        assert err.value.retryable is False
        assert tool.call("add", {"a": 2, "b": 40}) == "42"
        assert tool.metrics()["reconnects"] == 1 and tool.server_pid != pid
        deadline = time.monotonic() + 10   # the hung server is stopped in the background
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
    finally:
        tool.close()
    tool.close()   # twice is fine


def test_executor_reports_a_killed_server_as_infra():
    cfg = {"tool_instances": {"calc": {"class_path": "verl_arpo.workers.rollout.tools.mcp_tool.MCPTool",
                                       "params": {"command": COMMAND, "name": "calc", "call_timeout": 10},
                                       "timeout": 15}}}
    with ToolExecutor.from_config(cfg) as ex:
        tool = ex.tools["calc"]
        pid = tool.server_pid
        th, box = _in_background(ex.execute, "calc", FunctionCall("sleep", {"seconds": 5}))
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        th.join(20)
        r = box["result"]   # a ToolResult, not an exception
        assert (r.ok, r.infra, r.timed_out, r.attempts) == (False, True, False, 1)
        assert r.text.startswith("Error: MCP server calc: ") and r.seconds < 3
        r = ex.execute("calc", FunctionCall("add", {"a": 2, "b": 40}))
        assert (r.text, r.ok) == ("42", True)
        m = ex.metrics()
        assert m["tools/calc/infra_failures"] == 1 and m["tools/calc/reconnects"] == 1


# ------------------------------------------------------------------------ config and secrets
def test_bad_config():
    for kwargs in ({}, {"command": COMMAND, "url": "http://127.0.0.1:1/mcp"}):
        with pytest.raises(ValueError, match=r"params\.command.*params\.url"):
            MCPTool(**kwargs)
    with pytest.raises(ValueError, match=r"params\.tools.*'divide'"):
        MCPTool(command=COMMAND, tools=["add", "divide"])
    with pytest.raises(ToolInfraError, match="could not connect"):
        MCPTool(command=["/nonexistent/mcp-server"], connect_timeout=5)
    tool = MCPTool(command=COMMAND, tools=["add", "echo"], env={"CALC_TOKEN": "ENVSECRET789"})
    try:
        assert {f["function"]["name"] for f in tool.functions()} == {"add", "echo"}
        assert tool.call("add", {"a": 3, "b": 4}) == "7"
        with pytest.raises(ToolError, match="no function 'sleep'"):
            tool.call("sleep", {"seconds": 0})
        assert "ENVSECRET789" not in repr(tool) and "CALC_TOKEN" in repr(tool)
    finally:
        tool.close()


def test_connect_is_bounded_by_connect_timeout():
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]   # starts, never answers the handshake
    t0 = time.monotonic()
    with pytest.raises(ToolInfraError, match=r"could not connect \(command=.*, within 1 s\)"):
        MCPTool(command=silent, connect_timeout=1)
    assert time.monotonic() - t0 < 8   # 1 s, then the SDK's bounded shutdown of the silent process


def test_secrets_stay_out_of_connection_errors_and_logs(caplog):
    port = _free_port()   # closed: nothing listens on it
    token, key, query = "SECRET" + "123", "KEYSECRET" + "456", "QUERYSECRET" + "789"   # not in this source
    caplog.set_level(logging.DEBUG)
    t0 = time.monotonic()
    with pytest.raises(ToolInfraError) as err:
        MCPTool(url=f"http://127.0.0.1:{port}/mcp?key={query}", connect_timeout=2, name="remote",
                headers={"Authorization": f"Bearer {token}", "X-Api-Key": key})
    assert time.monotonic() - t0 < 10
    assert f"127.0.0.1:{port}" in str(err.value) and "could not connect" in str(err.value)
    assert err.value.retryable   # nothing was sent: another attempt is safe
    shown = "".join(traceback.format_exception(err.value))   # the chain as a log would print it
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("verl_arpo"))
    for secret in (token, key, query):
        assert secret not in shown and secret not in ours
    for secret in (token, key):   # the SDK's own debug log names the URL (with its query), never a header
        assert secret not in caplog.text
