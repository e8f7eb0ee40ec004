"""nearpolicy's MCP tool server (stdio): `calculator` (tools/calculator.py) and `python` (tools/sandbox.py).

    python -m nearpolicy.tools.server          # speaks MCP on stdin/stdout; any MCP client can use it

Tool results are text; a failure is returned as text starting with "error:" (the model reads it as an
observation), never raised into the protocol."""

from __future__ import annotations

from mcp.server import MCPServer

from nearpolicy.tools.calculator import calculate
from nearpolicy.tools.sandbox import run_python

server = MCPServer("nearpolicy-tools", log_level="WARNING")  # its INFO lines would fill the run's stderr
PYTHON_TIMEOUT_S = 5.0
PYTHON_MEMORY_MB = 512


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses), e.g. "123 * 456"."""
    try:
        return calculate(expression)
    except (ValueError, ZeroDivisionError, ArithmeticError) as err:
        return f"error: {err}"


@server.tool()
def python(code: str) -> str:
    """Run Python code in a sandbox (5 s, 512 MB, no network, no processes) and return what it prints."""
    result = run_python(code, timeout_s=PYTHON_TIMEOUT_S, memory_mb=PYTHON_MEMORY_MB)
    if result.status == "ok":
        return result.output
    return f"error: {FAILURES.get(result.status, result.status)}\n{result.output}".rstrip()


FAILURES = {"error": "the code raised an exception", "timeout": f"the code ran past {PYTHON_TIMEOUT_S:g} s",
            "memory": f"the code ran out of memory ({PYTHON_MEMORY_MB} MB)", "killed": "the code was killed"}


if __name__ == "__main__":
    server.run("stdio")
