"""Runs a command (argv[1:]) with SIGINT's default action restored, for device_check.sh's stages.

A shell without job control (`nohup bash device_check.sh &`, a CI runner's background step) starts its commands
with SIGINT ignored, and an ignored signal stays ignored across exec: Python then installs no KeyboardInterrupt
handler, so the INT a stage gets at its budget would do nothing, and after timeout's KILL pytest would leave no junit
XML, losing the results of every kernel that finished. bash cannot undo that itself (a signal ignored on entry to a
non-interactive shell cannot be trapped or reset), so this exec does.
"""

import os
import signal
import sys

signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
