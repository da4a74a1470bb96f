"""Check built distributions: ``twine check --strict``, and that the wheel ships its data files.

Usage: ``python .ci/check_dist.py DIST_DIR`` (run by ``tox -e build``).  The wheel must contain
``celery_caps/py.typed`` and every ``.lua`` file of the source tree's ``celery_caps/`` package.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(dist_dir: str) -> int:
    folder = Path(dist_dir)
    wheels = sorted(folder.glob("*.whl"))
    sdists = sorted(folder.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {folder}, found {wheels + sdists}", file=sys.stderr)
        return 1
    subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists)], check=True)
    required = {"celery_caps/py.typed"}
    required |= {path.relative_to(ROOT).as_posix() for path in (ROOT / "celery_caps").rglob("*.lua")}
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
    missing = sorted(required - names)
    if missing:
        print(f"{wheels[0].name} lacks {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"{wheels[0].name}: contains {', '.join(sorted(required))}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
