#!/usr/bin/env bash
# Apply patches/*.patch (sorted by name) to the installed SGLang.
#
#   bash scripts/apply_patches.sh              # patches/ of this repository
#   bash scripts/apply_patches.sh --check      # only check that each applies (or is applied); change nothing
#   PATCHES_DIR=... SITE_DIR=... bash scripts/apply_patches.sh
#
# A patch is a unified diff against the pinned SGLang (0.5.17) with paths
# relative to the folder that holds the `sglang` package (site-packages),
# prefixed `a/` and `b/` as `git diff` writes them: `a/sglang/srt/...`
# (PATCH_STRIP, default 1, is patch's -p). Each patch file should open with a
# paragraph saying why the plugin and hook mechanisms cannot do it.
#
# No patches/ folder, or one without *.patch files: nothing to do, exit 0.
# A patch that does not apply: every patch is checked (dry run) before any is
# applied; the script stops with exit 1 naming the patch and patch's output,
# leaving SGLang untouched. A patch that is already applied (it reverses
# cleanly) is skipped, so re-running is safe.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PATCHES_DIR="${PATCHES_DIR:-$ROOT/patches}"
PY="${PYTHON:-python3}"
STRIP="${PATCH_STRIP:-1}"
CHECK_ONLY=0
case "${1:-}" in
    "") ;;
    --check) CHECK_ONLY=1 ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

log() { echo "[apply_patches] $*"; }
die() { echo "[apply_patches] ERROR: $*" >&2; exit 1; }

if [[ ! -d "$PATCHES_DIR" ]]; then
    log "no patches folder ($PATCHES_DIR): nothing to apply"
    exit 0
fi
shopt -s nullglob
patches=("$PATCHES_DIR"/*.patch)
shopt -u nullglob
if (( ${#patches[@]} == 0 )); then
    log "no *.patch files in $PATCHES_DIR: nothing to apply"
    exit 0
fi
command -v patch >/dev/null || die "the 'patch' program is needed (apt-get install patch)"

if [[ -z "${SITE_DIR:-}" ]]; then
    # where the `sglang` package lives, found without importing it (no CUDA needed)
    SITE_DIR="$("$PY" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("sglang")
if spec is None or not spec.submodule_search_locations:
    sys.exit("sglang is not installed")
print(os.path.dirname(list(spec.submodule_search_locations)[0]))')" || die "cannot locate the installed sglang with $PY"
fi
[[ -d "$SITE_DIR" ]] || die "SITE_DIR $SITE_DIR is not a folder"
log "${#patches[@]} patch(es) for $SITE_DIR"

# 1. check every patch first, so a bad one leaves everything untouched
todo=()
for p in "${patches[@]}"; do
    name="$(basename "$p")"
    if out="$(patch -d "$SITE_DIR" -p"$STRIP" --dry-run --forward --batch --silent < "$p" 2>&1)"; then
        todo+=("$p")
    elif patch -d "$SITE_DIR" -p"$STRIP" --dry-run --reverse --batch --silent < "$p" >/dev/null 2>&1; then
        log "$name: already applied, skipped"
    else
        die "$name does not apply to $SITE_DIR (nothing was changed):
$out"
    fi
done

if (( CHECK_ONLY )); then
    log "check only: ${#todo[@]} would be applied, $(( ${#patches[@]} - ${#todo[@]} )) already there"
    exit 0
fi

# 2. apply
for p in ${todo[@]+"${todo[@]}"}; do
    patch -d "$SITE_DIR" -p"$STRIP" --forward --batch --silent --no-backup-if-mismatch < "$p" \
        || die "$(basename "$p") failed while applying (it passed the dry run)"
    log "$(basename "$p"): applied"
done
log "done: ${#todo[@]} applied, $(( ${#patches[@]} - ${#todo[@]} )) already there"
