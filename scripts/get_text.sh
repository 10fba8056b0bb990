#!/usr/bin/env bash
# Long real text for the perplexity benchmark, with no web fetch: the Python 3.11 tutorial followed by the
# HOWTOs, as reStructuredText sources that Debian's python3.11-doc package ships (PSF License 2.0;
# /usr/share/doc/python3.11-doc/copyright). Files are concatenated in their toctree order, so the text
# reads in order (~1 MB, ~250k SmolLM2 tokens). Output: out/texts/python311_tutorial_howto.txt (or $1).
# Tests never need this: they use tests/data/short_text.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=/usr/share/doc/python3.11/html/_sources
OUT=${1:-out/texts/python311_tutorial_howto.txt}
if [ ! -f "$SRC/tutorial/index.rst.txt" ]; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get install -y -q python3.11-doc >/dev/null
fi
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for part in tutorial howto; do
    # the entries of the index's toctree: indented lines ending in .rst after the ".. toctree::" line
    for name in $(awk '/^\.\. toctree::/{on=1; next} on && /^ +[a-z0-9_-]+\.rst$/{print $1}' "$SRC/$part/index.rst.txt"); do
        cat "$SRC/$part/$name.txt" >> "$OUT"
        printf '\n' >> "$OUT"
    done
done
echo "$OUT: $(wc -c < "$OUT") bytes"
