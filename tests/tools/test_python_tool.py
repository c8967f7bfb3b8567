"""PythonTool behaviour: REPL echo, tracebacks, timeouts, output limits, interpreter choice."""
import logging
import os
import shutil
import tempfile
import time

import pytest

from verl_arpo.workers.rollout.tools import python_tool
from verl_arpo.workers.rollout.tools.python_tool import PythonTool, trim_traceback


@pytest.fixture(scope="module")
def py():
    return PythonTool(timeout=10, max_output_chars=2000)


@pytest.mark.parametrize("code, expected", [
    ("print(2 + 2)", "4\n"),
    ("x = 3\nx * 2", "6\n"),                       # final bare expression echoed
    ("'héllo'", "'héllo'\n"),                      # REPL echo uses repr
    ("print('a')\n1 + 1\ny = 5", "a\n"),           # only the *last* statement is echoed
    ("x = [1,\n 2]\nlen(\n  x)", "2\n"),           # multi-line final expression
    ("print('it\\'s \"quoted\"')", "it's \"quoted\"\n"),  # the reference's -c '...' broke on quotes
    ("import math; math.sqrt(16)", "4.0\n"),       # `a; b` on one line: b is the last statement
    ("def f():\n    return 7\nf()", "7\n"),
])
def test_repl_echo(py, code, expected):
    assert py.execute(code) == expected


def test_no_output_and_none(py):
    assert py.execute("x = 1") == "Code executed successfully with no output."
    assert py.execute("None") == "Code executed successfully with no output."
    assert py.execute("print(1)") == "1\n"  # print(...) is not echoed again (no trailing None)


def test_preprocess_can_be_disabled():
    assert PythonTool(preprocess=False).execute("1 + 1") == "Code executed successfully with no output."


def test_traceback_is_trimmed_to_user_frames(py):
    out = py.execute("print('before')\ndef f(x):\n    return 1 / x\nf(0)")
    lines = out.splitlines()
    assert lines[0] == "before"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ZeroDivisionError: division by zero"
    assert 'File "<code>", line 4, in <module>' in out and 'File "<code>", line 3, in f' in out
    assert "return 1 / x" in out  # the model's own source line is shown
    for internal in ("exec(_code", "_LAUNCHER", "linecache", "__repl_echo__", "bwrap"):
        assert internal not in out


def test_deep_recursion_traceback_is_shortened(py):
    # mutual recursion: Python's own "[Previous line repeated]" folding does not apply
    out = py.execute("def f(n):\n    return g(n)\ndef g(n):\n    return f(n)\nf(0)")
    lines = out.splitlines()
    assert lines[-1].startswith("RecursionError")
    assert len(lines) <= 25 and "lines omitted" in out


def test_trim_traceback_function():
    tb = "Traceback (most recent call last):\n" + "".join(f"  line {i}\n" for i in range(100)) + "E: x"
    out = trim_traceback(tb, max_lines=10).splitlines()
    assert len(out) == 10 and out[0].startswith("Traceback") and out[-1] == "E: x"
    assert out[1] == "  ... (93 lines omitted)" and out[2] == "  line 93"


def test_syntax_error_reported(py):
    out = py.execute("x = (1,\nprint(x")
    assert "SyntaxError" in out and out.count("\n") < 10


def test_sys_exit_status(py):
    assert py.execute("import sys; sys.exit(3)") == "Error: process exited with status 3."
    assert py.execute("import sys; print('hi'); sys.exit(0)") == "hi\n"


def test_timeout_returns_message_and_partial_output():
    tool = PythonTool(timeout=1)
    t0 = time.monotonic()
    out = tool.execute("print('started', flush=True)\nwhile True:\n    pass")
    took = time.monotonic() - t0
    assert out == "started\nError: Execution timed out after 1 seconds."
    assert 0.9 <= took < 3


def test_huge_output_truncated_with_marker():
    tool = PythonTool(timeout=10, max_output_chars=1000)
    t0 = time.monotonic()
    out = tool.execute("while True:\n    print('y' * 1000)")  # would never end on its own
    assert time.monotonic() - t0 < 5  # killed as soon as the cap was passed, not at the timeout
    body, marker = out[:1000], out[1000:]
    assert set(body) <= {"y", "\n"} and body.count("y") >= 990
    assert marker == "\n... [output truncated: more than 1000 characters]"


def test_non_utf8_output_decoded_with_replacement(py):
    out = py.execute("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')\nsys.stdout.flush()")
    assert out == "ok \ufffd\ufffd end\n"


def test_code_reads_no_stdin(py):
    out = py.execute("input('? ')")
    assert out.splitlines()[-1] == "EOFError: EOF when reading a line"


def test_execute_never_raises_on_huge_code(py):
    assert py.execute("#" * 1_000_001).startswith("Error: code too long")


def test_seed_conda_params_fall_back_when_missing(caplog):
    caplog.set_level(logging.WARNING)
    tool = PythonTool(conda_path="/path/to/conda", conda_env="arpo")
    assert tool.python_path == "/usr/bin/python3"
    assert "/path/to/conda/envs/arpo/bin/python not found" in caplog.text


def test_conda_layout_interpreter_is_used():
    # <conda_path>/envs/<env>/bin/python, in a world-readable dir so uid 65534 can run it
    base = tempfile.mkdtemp(prefix="fakeconda_")
    try:
        os.chmod(base, 0o755)
        bindir = os.path.join(base, "envs", "myenv", "bin")
        os.makedirs(bindir)
        for d in (os.path.join(base, "envs"), os.path.dirname(bindir), bindir):
            os.chmod(d, 0o755)
        os.symlink("/usr/bin/python3", os.path.join(bindir, "python"))
        tool = PythonTool(conda_path=base, conda_env="myenv", timeout=10)
        assert tool.python_path == os.path.join(bindir, "python")
        assert tool.execute("import sys; sys.executable") == repr(os.path.join(bindir, "python")) + "\n"
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid-65534 readability check only applies as root")
def test_interpreter_unreadable_by_sandbox_user_is_rejected(tmp_path):
    # pytest's tmp_path is 0700 root: uid 65534 cannot reach an interpreter inside it
    fake = tmp_path / "python"
    fake.symlink_to("/usr/bin/python3")
    with pytest.raises(ValueError, match="not readable by uid 65534"):
        PythonTool(python_path=str(fake))


def test_bad_sandbox_value():
    with pytest.raises(ValueError):
        PythonTool(sandbox="docker")


def test_without_bubblewrap_auto_fails_closed_and_none_is_an_explicit_logged_opt_out(monkeypatch, caplog):
    from verl_arpo.workers.rollout.tools import sandbox

    monkeypatch.setattr(sandbox, "_probe_result", False)  # as if bwrap were missing
    monkeypatch.setattr(sandbox, "_probe_reason", "bwrap: No permissions to creating new namespace")
    for mode in ("auto", "bwrap"):
        with pytest.raises(python_tool.SandboxUnavailableError, match="No permissions.*sandbox=none"):
            PythonTool(timeout=10, sandbox=mode)
    caplog.set_level(logging.WARNING)
    tool = PythonTool(timeout=10, sandbox="none")
    assert tool.execute("1 + 1") == "2\n" and tool.execute("2 + 2") == "4\n"
    assert "WITHOUT network or filesystem isolation" in caplog.text
    assert tool.metrics() == {"unsandboxed": 1.0}