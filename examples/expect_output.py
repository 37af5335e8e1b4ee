"""Runs a program and fails unless its standard output is exactly the expected text."""
import subprocess
import sys

program, expected = sys.argv[1], sys.argv[2].encode().decode("unicode_escape")
output = subprocess.run([program], check=True, capture_output=True, text=True).stdout
if output != expected:
    sys.exit(f"{program} printed {output!r}, expected {expected!r}")
