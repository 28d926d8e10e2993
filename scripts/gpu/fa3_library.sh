#!/usr/bin/env bash
# Sourced on the GPU host after scripts/gpu/setup.sh: stock SGLang's FA3 library (sgl_kernel/flash_ops, which the
# bundle trims) joined from the pieces carried so far (c01-c04, scripts/gpu/pieces.py), once per warm machine.
# Quiet when the library is there already or no FA3 piece has arrived; says so when the join fails.
python3 scripts/gpu/pieces.py collect .pieces --into /tmp/pieces > /dev/null 2>&1 || true
_fa3_site=$(python3 -c "import sgl_kernel, os; print(os.path.dirname(sgl_kernel.__file__))")
if [ ! -f "$_fa3_site/flash_ops.abi3.so" ] && ls /tmp/pieces/fa3.* > /dev/null 2>&1; then
  # the join decompresses with zstandard (its wheel comes with the first piece; a fresh machine lacks it)
  if ls /tmp/pieces/zstandard-*.whl > /dev/null 2>&1 && ! python3 -c "import zstandard" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/site /tmp/pieces/zstandard-*.whl
  fi
  python3 scripts/gpu/pieces.py join fa3 --dir /tmp/pieces --out "$_fa3_site/flash_ops.abi3.so" --unzstd \
    || echo "fa3 library: join failed (are pieces c01-c04 all here?)"
fi
if [ -f "$_fa3_site/flash_ops.abi3.so" ]; then
  python3 -c "from sgl_kernel.flash_attn import flash_attn_varlen_func; print('fa3 library: ok')" 2>&1 | tail -1
fi
unset _fa3_site
