#!/usr/bin/env bash
# Render RUN_DIR/reports/report.html (or any HTML file) to a PNG with headless Chromium,
# to check that a report displays offline. Usage: scripts/render_report.sh RUN_DIR|FILE.html OUT.png [WIDTH,HEIGHT]
# Chromium: apt-get install -y chromium (Debian) or set CHROMIUM=/path/to/chrome.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RUN_DIR|FILE.html OUT.png [WIDTH,HEIGHT]" >&2
  exit 2
fi
target=$1
out=$2
size=${3:-1400,3000}
if [ -d "$target" ]; then
  page="$target/reports/report.html"
else
  page="$target"
fi
if [ ! -f "$page" ]; then
  echo "$0: $page not found (run: kiln report RUN_DIR)" >&2
  exit 2
fi
browser=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
if [ -z "$browser" ]; then
  echo "$0: chromium not found; install it (apt-get install -y chromium) or set CHROMIUM" >&2
  exit 2
fi
page=$(cd "$(dirname "$page")" && pwd)/$(basename "$page")
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --screenshot="$out" --window-size="$size" "file://$page" >/dev/null 2>&1
if [ ! -s "$out" ]; then
  echo "$0: chromium wrote no screenshot to $out" >&2
  exit 1
fi
echo "$out"
