#!/usr/bin/env bash
# `make gpu-travel` / `make gpu-travel-back`: the shipped expert weights (~140 MB, tracked) out of the tree that
# travels to a lent GPU machine and back. The device takes 64 MiB in all (tracked files, untracked files git
# does not ignore, carried paths); the GPU checks use random weights and the oracle drafter, never the experts.
# `out` takes the weights out of the index (the files stay on disk) and ignores them; `back` restores both.
# Never commit between the two: the commit would delete the weights (the script refuses to go out with staged work).
set -euo pipefail
cd "$(dirname "$0")/.."
WEIGHTS=specmesh/experts/*/*/weights.safetensors
EXCLUDE=.git/info/exclude
MARK="# gpu-travel: expert weights held back (make gpu-travel-back)"
case "${1:-}" in
  out)
    if ! git diff --cached --quiet; then echo "staged changes: commit or unstage them first" >&2; exit 1; fi
    mkdir -p .git/info
    grep -qxF "$MARK" "$EXCLUDE" 2>/dev/null || printf '%s\n/specmesh/experts/*/*/weights.safetensors\n' "$MARK" >>"$EXCLUDE"
    git rm -q --cached $WEIGHTS
    echo "expert weights out of the index; $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes tracked now"
    echo "carry .whl (make gpu-wheels) in the device call; run 'make gpu-travel-back' before committing anything"
    ;;
  back)
    git add -f $WEIGHTS
    if [ -f "$EXCLUDE" ]; then
      awk -v mark="$MARK" '$0 == mark {skip = 1; next} skip > 0 {skip--; next} {print}' "$EXCLUDE" >"$EXCLUDE.tmp"
      mv "$EXCLUDE.tmp" "$EXCLUDE"
    fi
    if git diff --cached --quiet -- specmesh/experts; then echo "expert weights tracked again, unchanged"
    else echo "the expert weights differ from the last commit: check 'git diff --cached'" >&2; exit 1; fi
    ;;
  *) echo "usage: $0 out|back" >&2; exit 2 ;;
esac
