"""The README's library quick start runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_library_quick_start_runs_as_written(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert blocks, "README has no python quick start"
    code = blocks[0].replace("/tmp/flowdecision-quickstart", str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "engine accepted dec-1 attempt 1"
    assert lines[1:3] == ["submitted 1", "duplicate False"]
    assert "'completed': 1" in lines[3] and "'duplicates': 1" in lines[3]
