#!/usr/bin/env bash
# The C extension's safety net, run by `make test` (target c-check) before pytest:
#
# 1. strict: every extension setup.py lists built with FLOWDECISION_C_BUILD=strict
#    (-Wall -Wextra -Werror, not optional): a warning fails the run.
# 2. sanitize: built with AddressSanitizer and UndefinedBehaviorSanitizer
#    (FLOWDECISION_C_BUILD=sanitize), then the differential and fuzz tests
#    (tests/test_fastreq.py) run against that build.
#
# Both builds go to a temporary directory: the installed extension (the
# lenient, optional build of `pip install`) is left as it is.
#
# Usage: bash tests/c_check.sh [python]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
# The extensions' tests (setup.py lists the extensions themselves).
tests=(tests/test_fastreq.py)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

build() { # build <mode> <lib dir>
    FLOWDECISION_C_BUILD=$1 "$python" setup.py --quiet build_ext \
        --build-lib "$2" --build-temp "$work/temp-$1"
}

echo "c-check: strict build (-Wall -Wextra -Werror)"
build strict "$work/strict"

echo "c-check: ASan + UBSan build"
# A copy of the package with the sanitized extensions in it, put first on
# PYTHONPATH (ahead of the editable install's src/).
mkdir "$work/sanitize"
cp -r src/flowdecision "$work/sanitize/"
find "$work/sanitize" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
build sanitize "$work/sanitize"

# The interpreter is not sanitized, so ASan's runtime must be loaded first, before
# libc's malloc is in use: preload the one the extensions were linked against.
extension=$(find "$work/sanitize/flowdecision" -name '*.so' | head -n 1)
asan=$(ldd "$extension" | awk '$1 ~ /^libasan\.so/ { print $3 }')
if [ ! -f "$asan" ]; then
    echo "c-check: no ASan runtime found for $extension" >&2
    exit 1
fi
sanitized=(
    env
    LD_PRELOAD="$asan"
    # CPython frees little at exit by design: leak reports would be its, not ours.
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    # Every PyMem_* block through malloc, so ASan sees the extensions' buffers
    # (pymalloc would carve small ones out of its arenas, out of ASan's sight).
    PYTHONMALLOC=malloc
    PYTHONPATH="$work/sanitize"
    "$python"
)

# The tests must be importing the sanitized build, not the installed one.
"${sanitized[@]}" - "$work/sanitize/flowdecision" <<'EOF'
import importlib
import sys
from pathlib import Path

built = Path(sys.argv[1])
names = sorted(path.name.split(".")[0] for path in built.glob("*.so"))
assert names, f"no extension was built in {built}"
for name in names:
    where = Path(importlib.import_module(f"flowdecision.{name}").__file__).parent
    assert where == built, f"flowdecision.{name} from {where}, not the sanitized build"
print("c-check: sanitized", ", ".join(names))
EOF

echo "c-check: differential and fuzz tests under ASan + UBSan"
# --capture=sys: a sanitizer reports on file descriptor 2 and then aborts the
# process, so pytest must not be holding that descriptor's output.
"${sanitized[@]}" -m pytest -q -p no:cacheprovider --capture=sys "${tests[@]}"
