"""Regenerate the flag tables of the READMEs from the config declarations (tito.settings_docs).

    python scripts/flag_tables.py           rewrite the tables in place
    python scripts/flag_tables.py --check   exit 1, naming the files, when a table is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tito.settings_docs import DOCUMENTS, render_tables  # noqa: E402 - after the path of this checkout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; change nothing")
    args = parser.parse_args()
    stale = []
    for name in DOCUMENTS:
        path = ROOT / name
        text = path.read_text()
        fresh = render_tables(text)
        if fresh != text:
            stale.append(name)
            if not args.check:
                path.write_text(fresh)
    if stale and args.check:
        print(f"flag tables out of date in {', '.join(stale)}: run python scripts/flag_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
