#!/bin/bash
# Kill `gr2 run` with SIGKILL during a training stage once it has saved a resume state,
# then run it again: the rerun should mark the killed runs KILLED and resume the stage.
#
#   experiments/kill_resume_demo.sh WORKSPACE [STAGE]     (STAGE default: sft)
#
# The stage must be out of date (change one of its params first) and its params.yaml
# `resume.every_steps` small enough to save before it ends. Prints both runs' consoles.
set -euo pipefail
ws=$1; stage=${2:-sft}
cd "$ws"
setsid gr2 run --stage "$stage" > kill_demo_run1.out 2>&1 &
pid=$!
until [ -n "$(find ".gr2/resume/$stage" -name 'step-*' 2>/dev/null)" ]; do
  kill -0 "$pid" 2>/dev/null || { echo "gr2 run ended before $stage saved a state"; cat kill_demo_run1.out; exit 1; }
  sleep 0.2
done
sleep 0.5  # let it train a little past the first save
echo "saved states before the kill:"; find ".gr2/resume/$stage" -maxdepth 3 -name "step-*" || true
kill -9 -- "-$pid"
sleep 2
gr2 run --stage "$stage" 2>&1 | tee kill_demo_run2.out  # the console lines are on stderr
