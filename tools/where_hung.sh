#!/usr/bin/env bash
# Where a hung kernel's warps are: run a command, and if it is still running after a wait, attach
# cuda-gdb and print every warp's PC of the focused SM and the instructions there (SASS, with the
# source line when the build has line info). For kernels that never finish (a barrier or
# setmaxnreg waiting forever). Needs cuda-gdb (the H200 machines have it).
#
#   bash tools/where_hung.sh 25 python3 my_hanging_call.py
set -uo pipefail
WAIT_S=${1:?seconds to wait before attaching}
shift
"$@" &
PID=$!
sleep "$WAIT_S"
if ! kill -0 "$PID" 2>/dev/null; then
  wait "$PID"
  echo "finished within ${WAIT_S} s (exit $?): nothing hung"
  exit 0
fi
commands=(-ex "info cuda kernels" -ex "info cuda warps")
for warp in 0 4 5 8 9; do  # the producer's first warp and two warps of each consumer warpgroup
  commands+=(-ex "cuda warp $warp" -ex "x/4i \$pc")
done
timeout 120 cuda-gdb -p "$PID" -batch "${commands[@]}" 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited\]"
kill -9 "$PID"
