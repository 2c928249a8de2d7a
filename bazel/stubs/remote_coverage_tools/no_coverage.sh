#!/bin/sh
# Stand-in for Bazel's downloadable coverage tools (see docs/bazel.md).
echo "jzyfa's offline Bazel setup stubs out @remote_coverage_tools:" \
     "'bazel coverage' is not supported." >&2
exit 1
