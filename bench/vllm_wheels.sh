#!/usr/bin/env bash
# vLLM on the lent H200 (no registry there): its wheels, downloaded here, carried in parts, installed there.
#
# Here (once; needs PyPI):
#   bash bench/vllm_wheels.sh prepare     download every pin of the list, check Requires-Dist and imports,
#                                         pack into .whl-parts/partN/ (each < 55 MiB: xz bundle pieces + SHA256SUMS)
#   (steps alone: download, check, pack)
# There (each device call carries one or more parts; `carry: [".whl-parts/part1", ...]`):
#   bash bench/vllm_wheels.sh install     copy the carried parts to /tmp/whl (kept while the machine stays warm);
#                                         once all are there: reassemble, sha256 check, rebuild the vLLM wheel
#                                         (every file against its RECORD), pip install --no-deps --target /tmp/site
#                                         exit 0: installed (or was already); 3: parts still missing (which, printed)
#   then run vLLM with PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 (bench/compare_vllm.sh does).
#
# LIST=/work/shared/design/vllm-0.26.0-wheels.txt  DIR=.whl-parts  KINDS=/work/.library/device/KINDS.md
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=${LIST:-/work/shared/design/vllm-0.26.0-wheels.txt}
DIR=${DIR:-.whl-parts}
KINDS=${KINDS:-/work/.library/device/KINDS.md}
PY=${PY:-python3}
WHL=${WHL:-/tmp/whl}
SITE=${SITE:-/tmp/site}
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

ignored() {  # the parts must never travel with every call: keep DIR out of git's view (local exclude, not tracked)
  git check-ignore -q "$DIR/x" && return
  local ex; ex="$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p "$(dirname "$ex")" && echo "/$DIR/" >> "$ex"
  echo "added /$DIR/ to $ex"
}

download() {
  ignored
  mkdir -p "$DIR/dl"
  local pin
  for pin in $(grep -v '^#' "$LIST" | sed 's/#.*//'); do
    local name=${pin%%==*}
    if ls "$DIR/dl/" | grep -qi "^${name//-/_}-${pin##*==}-"; then continue; fi
    local args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$DIR/dl" -q)
    if ! $PY -m pip download "${args[@]}" "${PLATFORMS[@]/#/--platform=}" "$pin" 2>/dev/null; then
      local n ok=
      for n in 24 31 34 35 26 29 30 32 33 36 37 38 39; do   # pip matches manylinux_2_N exactly
        if $PY -m pip download "${args[@]}" "--platform=manylinux_2_${n}_x86_64" "$pin" 2>/dev/null; then ok=1; break; fi
      done
      [[ -n $ok ]] || { echo "no wheel for $pin" >&2; return 1; }
    fi
  done
  ls "$DIR/dl" | wc -l | xargs echo "wheels in $DIR/dl:"
}

check() { $PY bench/vllm_wheels.py check "$DIR/dl" "$LIST" ${KINDS:+--image-packages "$KINDS"}; }

pack() { nice $PY bench/vllm_wheels.py pack "$DIR/dl" "$DIR" --part-mib 50; }

install() {
  if PYTHONPATH=$SITE $PY -c "import vllm, sys; sys.exit(vllm.__version__ != '0.26.0')" 2>/dev/null; then
    echo "vllm 0.26.0 already in $SITE"; return 0
  fi
  mkdir -p "$WHL"
  cp -n "$DIR"/part*/* "$WHL"/ 2>/dev/null || true
  local sums=$WHL/SHA256SUMS
  [[ -f $sums ]] || { echo "no parts carried yet (carry .whl-parts/partN)"; return 3; }
  local want; want=$(sed -n 's/^# parts: //p' "$sums")
  local missing=() i
  for ((i = 1; i <= want; i++)); do [[ -f $WHL/bundle.tar.xz.$(printf %02d "$i") ]] || missing+=("part$i"); done
  if (( ${#missing[@]} )); then echo "have $(( want - ${#missing[@]} ))/$want parts in $WHL; still to carry: ${missing[*]}"; return 3; fi
  local t0=$SECONDS
  (cd "$WHL" && grep 'bundle.tar.xz.[0-9]' SHA256SUMS | sha256sum -c --quiet) || { echo "a part's sha256 differs" >&2; return 1; }
  cat "$WHL"/bundle.tar.xz.[0-9]* > "$WHL/bundle.tar.xz"
  (cd "$WHL" && grep ' bundle.tar.xz$' SHA256SUMS | sha256sum -c --quiet) || { echo "bundle sha256 differs" >&2; return 1; }
  rm -rf "$WHL/x" "$WHL/wheels" && mkdir -p "$WHL/x"
  xz -d -T0 -c "$WHL/bundle.tar.xz" | tar -x -C "$WHL/x"
  $PY bench/vllm_wheels.py rebuild "$WHL/x" "$WHL/wheels"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/wheels/*.whl
  rm -rf "$WHL/x" "$WHL/bundle.tar.xz"
  PYTHONPATH=$SITE $PY -c "import vllm; print('vllm', vllm.__version__, 'installed in $SITE')"
  echo "install took $(( SECONDS - t0 )) s"
}

case ${1:-} in
  download) download ;;
  check) check ;;
  pack) pack ;;
  prepare) download && { check || true; } && pack ;;
  install) install ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
