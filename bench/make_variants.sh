#!/usr/bin/env bash
# Builds .variants/NAME/ for an A/B of kernel changes in one GPU run: each folder is the tqkv_compile package
# of one commit as it installs (passes/ and lowerings/ mapped inside it), importable with PYTHONPATH=folder.
# The device's copy of .git is stale, so the trees are built here and carried (bench/h200_session.sh variants).
#   bash bench/make_variants.sh main=a9caf0c cut1=d9cfd73 ...    (NAME=commit; the order is the run's order)
#   NAME=commit@VAR=value,VAR2=value: the variant runs with those environment variables (ENV in its folder),
#   e.g. arrive=4a83c62@TQKV_LAST_ARRIVER=1
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .variants && mkdir -p .variants
grep -qx '/.variants/' .git/info/exclude 2>/dev/null || echo '/.variants/' >> .git/info/exclude
i=0
for spec in "$@"; do
    name=${spec%%=*} rev=${spec#*=} env=""
    if [[ $rev == *@* ]]; then env=${rev#*@}; rev=${rev%%@*}; fi
    i=$((i + 1)); dir=.variants/$(printf %02d "$i")-$name
    tmp=$(mktemp -d)
    git archive "$rev" tqkv_compile passes lowerings | tar -x -C "$tmp"
    mkdir -p "$dir"
    mv "$tmp/tqkv_compile" "$dir/"; mv "$tmp/passes" "$dir/tqkv_compile/passes"; mv "$tmp/lowerings" "$dir/tqkv_compile/lowerings"
    git rev-parse --short "$rev" > "$dir/COMMIT"
    [ -n "$env" ] && echo "$env" | tr ',' ' ' > "$dir/ENV"
    rm -rf "$tmp"
    echo "$dir: $(cat "$dir/COMMIT")${env:+ with $env} $(git log -1 --format=%s "$rev" | cut -c1-60)"
done
du -sh .variants
