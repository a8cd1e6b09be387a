#!/usr/bin/env bash
# vLLM on the lent H200 (no registry there): its wheels, downloaded here, carried in parts, installed there.
#
# Here (once; needs PyPI):
#   bash bench/vllm_wheels.sh prepare     download every pin of the list, check Requires-Dist and imports,
#                                         pack into .whl-parts/partN/ (each <= 50 MiB: pieces of one xz stream of
#                                         the small wheels and vLLM, + SHA256SUMS) and .whl-parts/fa2-partN/ (vLLM's
#                                         FlashAttention-2 kernels, optional: unused on Hopper, see vllm_wheels.py)
#   (steps alone: download, check, pack)
# There (each device call carries one or more parts; `carry: [".whl-parts/part1", ...]`):
#   bash bench/vllm_wheels.sh install     copy the carried parts to /tmp/whl (kept while the machine stays warm);
#                                         once every partN is there (fa2-partN: all or none): reassemble, sha256
#                                         check of each piece and stream, rebuild the vLLM wheel (every file against
#                                         its RECORD), pip install --no-index --no-deps --target /tmp/site
#                                         exit 0: installed (or was already); 3: parts still missing (printed)
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

stream_state() {  # stream_state KIND -> "complete", "absent" or "partial: partN ..." (pieces in $WHL)
  local kind=$1 want have=0 i missing=()
  want=$(sed -n "s/^# $kind parts: //p" "$WHL/SHA256SUMS")
  [[ ${want:-0} == 0 ]] && { echo absent; return; }   # a pack without this (optional) stream
  local prefix=part; [[ $kind == core ]] || prefix=$kind-part
  for ((i = 1; i <= want; i++)); do
    if [[ -f $WHL/$kind.tar.xz.$(printf %02d "$i") ]]; then have=$((have + 1)); else missing+=("$prefix$i"); fi
  done
  if (( have == want )); then echo complete; elif (( have == 0 )); then echo absent; else echo "partial: ${missing[*]}"; fi
}

join_stream() {  # join_stream KIND: check each piece and the whole stream against SHA256SUMS, unpack into $WHL/x
  local kind=$1
  (cd "$WHL" && grep " $kind.tar.xz.[0-9]*$" SHA256SUMS | sha256sum -c --quiet) || { echo "$kind: a piece's sha256 differs" >&2; return 1; }
  cat "$WHL/$kind.tar.xz".[0-9]* > "$WHL/$kind.tar.xz"
  (cd "$WHL" && grep " $kind.tar.xz$" SHA256SUMS | sha256sum -c --quiet) || { echo "$kind: stream sha256 differs" >&2; return 1; }
  xz -d -T0 -c "$WHL/$kind.tar.xz" | tar -x -C "$WHL/x"
  rm -f "$WHL/$kind.tar.xz"
}

install() {
  if PYTHONPATH=$SITE $PY -c "import vllm, sys; sys.exit(vllm.__version__ != '0.26.0')" 2>/dev/null; then
    echo "vllm 0.26.0 already in $SITE"; return 0
  fi
  mkdir -p "$WHL"
  local d
  for d in "$DIR"/part* "$DIR"/*-part*; do [[ -d $d ]] && cp -n "$d"/* "$WHL"/; done
  [[ -f $WHL/SHA256SUMS ]] || { echo "no vLLM parts carried yet (carry .whl-parts/part1 ...)"; return 3; }
  local core fa2
  core=$(stream_state core); fa2=$(stream_state fa2)
  echo "vLLM parts in $WHL: core $core; fa2 (optional) $fa2"
  if [[ $core != complete ]]; then echo "still to carry: ${core#partial: }"; return 3; fi
  if [[ $fa2 == partial* && ${VLLM_FA2:-1} != 0 ]]; then
    echo "still to carry: ${fa2#partial: } (or VLLM_FA2=0 to install without FlashAttention-2)"; return 3
  fi
  local t0=$SECONDS
  rm -rf "$WHL/x" "$WHL/wheels" && mkdir -p "$WHL/x"
  join_stream core || return 1
  if [[ $fa2 == complete ]]; then join_stream fa2 || return 1; fi
  $PY bench/vllm_wheels.py rebuild "$WHL/x" "$WHL/wheels" || return 1
  # shellcheck disable=SC2086 # PIP_EXTRA: only for a dry run elsewhere (e.g. --python-version 3.12 --platform ...)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" ${PIP_EXTRA:-} \
    "$WHL"/wheels/*.whl || return 1
  rm -rf "$WHL/x"
  PYTHONPATH=$SITE $PY -c "import vllm; print('vllm', vllm.__version__, 'installed in $SITE')" || return 1
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
