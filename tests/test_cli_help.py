"""``qkv --help`` and ``qkv COMMAND --help`` answer without importing torch (or the other heavy libraries),
which takes seconds: the parser is built from :mod:`qkv.options` and the commands import what they run only
when they run. This counts imports, not seconds, so a slow machine cannot make it fail."""

import json
import subprocess
import sys

from clitools import ENV, HANG

HEAVY = ("torch", "numpy", "tokenizers", "transformers", "safetensors", "matplotlib", "sacrebleu")

# In a fresh interpreter: `--help` at every level of the parser (`qkv train lm --help` included), and after each
# one the heavy modules loaded so far.
CHILD = f"""
import argparse, contextlib, io, json, sys
from qkv.cli import build_parser, main

def commands(parser, path=()):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, (*path, name))

report = []
for path in commands(build_parser()):
    help = io.StringIO()
    try:
        with contextlib.redirect_stdout(help):
            main([*path, "--help"])
        status = None
    except SystemExit as stop:
        status = stop.code
    loaded = [m for m in {HEAVY!r} if m in sys.modules]
    report.append({{"command": " ".join(("qkv", *path, "--help")), "status": status,
                    "usage": help.getvalue().startswith("usage:"), "loaded": loaded}})
print(json.dumps(report))
"""


def test_help_of_every_command_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", CHILD], env=ENV, capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    commands = {row["command"] for row in report}
    assert {f"qkv {c}--help" for c in ("", "demo ", "train ", "train lm ", "generate ", "explore ")} <= commands
    assert all(row["status"] == 0 and row["usage"] for row in report), [r for r in report if r["status"] != 0]
    heavy = [(row["command"], row["loaded"]) for row in report if row["loaded"]]
    assert not heavy, f"--help imported heavy modules (first: {heavy[0]})"
