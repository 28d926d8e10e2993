"""The table of an end-to-end A/B's runs so far (`one_window_ab.sh`, `code_ab.sh`): one row per server run, from
each run's `speed.json` under the given folder.

    python3 scripts/gpu/ab_table.py /tmp/res/code_ab
"""

from __future__ import annotations

import json
import pathlib
import sys


def table(root: pathlib.Path) -> list[str]:
    lines = ["| run | method | TTFT ms (median) | rounds |", "| --- | --- | --- | --- |"]
    for f in sorted(root.glob("*/speed.json")):
        for r in json.loads(f.read_text()):
            rounds = ", ".join(f"{x:.1f}" for x in r["ms_all"])
            lines.append(f"| {f.parent.name} | {r['method']} | {r['ms']:.1f} | {rounds} |")
    return lines


if __name__ == "__main__":
    print("\n".join(table(pathlib.Path(sys.argv[1]))))
