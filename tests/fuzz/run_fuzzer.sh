#!/bin/sh
# Runs one libFuzzer harness for a bounded time on a scratch copy of its seed corpus (libFuzzer
# adds the inputs it finds to its first corpus directory, which must not be the source tree).
#
#   run_fuzzer.sh HARNESS SEED_DIRECTORY [libFuzzer options...]
#
# Runs for $GRADACCUM_FUZZ_SECONDS seconds (default 60). Inputs are capped at 64 KiB, and any
# single allocation above 64 MiB is a finding (the loaders allocate at most what the input
# holds). Findings are written to $GRADACCUM_FUZZ_ARTIFACTS (default: the current directory).
set -eu
harness=$1
seeds=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$seeds"/* "$work"/
"$harness" -max_total_time="${GRADACCUM_FUZZ_SECONDS:-60}" -max_len=65536 -rss_limit_mb=2048 -malloc_limit_mb=64 \
  -timeout=20 -print_final_stats=1 -artifact_prefix="${GRADACCUM_FUZZ_ARTIFACTS:-./}" "$@" "$work"
