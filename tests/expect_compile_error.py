"""Passes when a compile command fails and its first error names what it should.

Usage: expect_compile_error.py EXPECTED_TEXT COMPILER [ARGS...]

Meson cannot build a target that is meant to fail, so each should-not-compile test runs the
compiler itself. The test fails if the code compiles, or if EXPECTED_TEXT is not in the first
error (the one a user reads), so a diagnostic that degrades into template noise is caught.
"""
import subprocess
import sys

expected, command = sys.argv[1], sys.argv[2:]
result = subprocess.run(command, capture_output=True, text=True)
output = result.stdout + result.stderr
if result.returncode == 0:
    sys.exit(f"compiled, but was expected to fail with: {expected}\ncommand: {' '.join(command)}")
errors = [line for line in output.splitlines() if ": error: " in line or ": fatal error: " in line]
if not errors:
    sys.exit(f"the compiler failed without an error line:\n{output}")
if expected not in errors[0]:
    sys.exit(f"the first error does not say {expected!r}:\n{errors[0]}\n\nfull output:\n{output}")
print(errors[0])
