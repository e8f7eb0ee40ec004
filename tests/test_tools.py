"""Tools for tool-use episodes (issue 18): the exact calculator, the Python sandbox's limits, and the MCP client,
which turns a crashing, hanging or unknown tool into an error observation and starts a new server after one."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from nearpolicy.tools.calculator import calculate
from nearpolicy.tools.client import Observation, ToolClient
from nearpolicy.tools.sandbox import namespace_prefix, run_python


@pytest.mark.parametrize("expression, value", [("123 * 456", "56088"), ("7/4", "1.75"), ("1/3", "1/3"),
                                               ("-(2**10)//3", "-342"), ("(3+4)*(5-2)%7", "0"),
                                               ("98765432109876543 * 12345678901", str(98765432109876543 * 12345678901)),
                                               ("0.1 + 0.2", "0.3"), ("1.0000000000000000001 - 1", "0.0000000000000000001"),
                                               ("0.12345678901234567890 * 10", "1.234567890123456789")])
def test_calculator_is_exact(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [("__import__('os')", "not Call"), ("x + 1", "not Name"),
                                                 ("9 ** 10 ** 9", "exponents"), ("2 +", "not an arithmetic")])
def test_calculator_refuses_what_is_not_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


def test_sandbox_output_is_capped_before_it_reaches_memory():
    started = time.monotonic()
    result = run_python("import sys\nwhile True: sys.stdout.write('x' * 10 ** 6)", timeout_s=5.0)
    assert result.status == "error" and "truncated at 2000 characters" in result.output
    assert time.monotonic() - started < 5  # stopped by the output file's size limit, not by the timeout


@pytest.mark.skipif(not namespace_prefix(), reason="unshare cannot make namespaces here (not root, no user namespaces)")
def test_sandbox_has_no_network_and_sees_no_other_process():
    result = run_python("import os; print(os.getpid())")
    assert result.output.strip() == "1"  # the first process of its own PID namespace


def test_sandbox_runs_code_in_a_temporary_folder_and_truncates_output():
    result = run_python("import os; open('f', 'w').write('x'); print(os.getcwd()); print('a' * 5000)", max_output=300)
    assert result.status == "ok" and "nearpolicy-sandbox-" in result.output
    assert result.output.endswith("[output truncated at 300 characters]") and len(result.output) < 360


@pytest.mark.parametrize("code, status, said", [
    ("while True: pass", "timeout", ""),
    ("x = bytearray(10 ** 10)", "memory", "MemoryError"),
    ("import socket", "error", "import of socket is not allowed"),
    ("import os; os.system('true')", "error", "has no attribute 'system'"),
    ("import gc", "error", "import of gc is not allowed"),
    ("import os; os.pidfd_open(1)", "error", "has no attribute 'pidfd_open'"),
    ("open('/tmp/nearpolicy-sandbox-escape', 'w')", "error", "only files in the working folder"),
    ("import os; os.open('/tmp/nearpolicy-sandbox-escape', os.O_WRONLY | os.O_CREAT)", "error", "working folder"),
    ("import ctypes", "error", "import of ctypes is not allowed"),
    ("1 / 0", "error", "ZeroDivisionError"),
])
def test_sandbox_limits_hold(code, status, said):
    started = time.monotonic()
    result = run_python(code, timeout_s=2.0, memory_mb=256)
    assert result.status == status and said in result.output
    assert time.monotonic() - started < 10  # the runaway loop is killed at the wall-clock limit
    assert "<string>" not in result.output  # the model sees its own frames, not the sandbox's prelude


CRASHY = textwrap.dedent('''
    import os, time
    from mcp.server import MCPServer
    server = MCPServer("crashy", log_level="WARNING")

    @server.tool()
    def crash() -> str:
        """Exit the server process."""
        os._exit(3)

    @server.tool()
    def hang() -> str:
        """Never answer."""
        time.sleep(3600)
        return "late"

    @server.tool()
    def echo(text: str) -> str:
        """Echo the text."""
        return text

    if __name__ == "__main__":
        server.run("stdio")
''')


def test_mcp_tools_answer_and_bad_calls_are_error_observations():
    client = ToolClient(call_timeout_s=20)
    try:
        assert client.tool_names() == ["calculator", "python"]
        assert client.call("calculator", {"expression": "17 * 23"}).text == "391"
        assert client.call("python", {"code": "print(sum(range(10)))"}).text.strip() == "45"
        unknown = client.call("nope", {})
        assert unknown.error == "tool_error" and "Unknown tool: nope" in unknown.text
        refused = client.call("calculator", {"expression": "x"})
        assert refused.error == "tool_error" and refused.text.startswith("error: only numbers")
        assert client.call("python", {"code": "import socket"}).text.startswith("error: the code raised an exception")
        assert dict(client.errors) == {"tool_error": 3}
    finally:
        client.close()


@pytest.fixture
def crashy_client(tmp_path):
    """A ToolClient on the CRASHY server (2 s call timeout), closed after the test."""
    script = tmp_path / "crashy.py"
    script.write_text(CRASHY)
    client = ToolClient((sys.executable, str(script)), call_timeout_s=2)
    try:
        yield client
    finally:
        client.close()


def test_a_server_that_dies_or_hangs_mid_episode_gives_an_error_observation_then_a_new_server(crashy_client):
    client = crashy_client
    try:
        assert client.call("echo", {"text": "one"}).text == "one"
        died = client.call("crash", {})
        assert died.error == "server_died" and died.text.startswith("error: the tool server failed")
        assert client.call("echo", {"text": "two"}).text == "two"  # a new server
        started = time.monotonic()
        hung = client.call("hang", {})
        assert hung.error == "timeout" and time.monotonic() - started < 6
        assert client.call("echo", {"text": "three"}).text == "three"
        assert dict(client.errors) == {"server_died": 1, "timeout": 1}
    finally:
        client.close()
    client.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        client.call("echo", {"text": "after"})


def test_a_call_queued_behind_a_hung_one_runs_on_the_next_server(crashy_client):
    from concurrent.futures import ThreadPoolExecutor

    client = crashy_client
    assert client.call("echo", {"text": "warm"}).text == "warm"
    with ThreadPoolExecutor(2) as pool:
        hung = pool.submit(client.call, "hang", {})
        time.sleep(0.5)  # the echo queues behind the hung call
        echoed = pool.submit(client.call, "echo", {"text": "queued"})
        assert hung.result().error == "timeout"
        assert echoed.result() == Observation("queued")
    assert dict(client.errors) == {"timeout": 1}


def test_a_server_that_cannot_start_is_an_error_observation():
    client = ToolClient(("/nonexistent/python",), call_timeout_s=2, start_timeout_s=5)
    try:
        failed = client.call("calculator", {"expression": "1"})
        assert failed.error == "server_died" and "No such file" in failed.text
    finally:
        client.close()
