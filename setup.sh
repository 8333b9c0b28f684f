#!/usr/bin/env bash
# Create .venv and install the project with its pinned stack (about 2 minutes the first time),
# plus Debian's Chromium for the report's browser test (tests/test_report_browser.py).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'

# Headless Chromium opens reports/index.html in a test. Installed from Debian's packages when
# missing and this shell may (root with apt-get); otherwise say so: the test then skips, except
# under CI=true, where it fails.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup.sh: installing chromium (Debian package) for the report's browser test"
        # A failed install leaves the Python set-up usable; the browser test then says what is missing.
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
            echo "setup.sh: chromium could not be installed; tests/test_report_browser.py will skip (fail under CI)" >&2
        fi
    else
        echo "setup.sh: chromium not installed and not root: run 'sudo apt-get install chromium' for the report's browser test" >&2
    fi
fi
