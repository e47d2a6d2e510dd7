#!/bin/sh
# Runs a command, then prints its exit status as the last line of the output. ctest ignores a
# test's exit status once the test has a PASS_REGULAR_EXPRESSION: tests that match the output
# run through this and end their expression with "exit status 0", so that a crash after the
# expected lines, or a rank of an mpirun job that failed without printing, still fails them.
"$@"
echo "exit status $?"
