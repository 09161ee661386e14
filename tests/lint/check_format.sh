#!/usr/bin/env bash
# Formatting (suite `lint`): every C, C++ and CUDA source of the tree is as the checked-in
# .clang-format says. The tree is formatted with clang-format 14 (Debian 12's; CI installs it):
# other major versions format some constructs differently, so with them, or without
# clang-format, the check is skipped (77), never passed. Fix a failure with
#   git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cc' | xargs clang-format -i
set -euo pipefail
cd "${1:?usage: check_format.sh SOURCE_ROOT}"
cf=$(command -v clang-format || true)
if [ -z "$cf" ]; then
  echo "SKIP: clang-format is not installed (apt-get install clang-format)"
  exit 77
fi
major=$("$cf" --version | sed -n 's/.*version \([0-9][0-9]*\)\..*/\1/p')
if [ "$major" != 14 ]; then
  echo "SKIP: clang-format ${major:-of unknown version}; the tree is formatted with version 14"
  exit 77
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cc')
else
  mapfile -t files < <(find client common daemon kernels proto tests examples -type f \
    \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cc' \) | sort)
fi
echo "checking ${#files[@]} files with $("$cf" --version)"
"$cf" --style=file --dry-run --Werror "${files[@]}"
echo "all ${#files[@]} files formatted"
