"""The `xserv` command, and what belongs to neither process: `xserv up` (up.py), which starts
the engine and the REST front as child processes, and `xserv bench` (bench/), a load generator
for any OpenAI-compatible endpoint. It imports the engine's and the front's argument parsers, never
torch (tests/rest/test_up_cli.py checks it)."""
