"""Tools for multi-turn tool-use episodes (issue 18), served over MCP (the `mcp` SDK, stdio transport): a calculator
and a sandboxed Python evaluator (server.py), the sandbox itself (sandbox.py) and a synchronous client that turns
every failure of a tool into an error observation (client.py)."""
